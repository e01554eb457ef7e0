"""The cluster side: policy, simulator, supervisor and executor."""
