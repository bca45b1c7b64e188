"""`servelab bench`: run one workload through several configs in one process and
compare them side by side (real runs, a transformers baseline, plots)."""
