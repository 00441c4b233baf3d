"""The GPU-free lab: a fake NVML driver and a simulated multi-GPU RTX serving workload."""
