"""Frozen copies of plugins written against earlier contract versions (never edited:
they stand for third-party code that was not updated)."""
