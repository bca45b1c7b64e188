"""Simulation: the engine's real schedulers and allocators driven by a roofline cost
model of a named accelerator and model shape instead of a model."""
