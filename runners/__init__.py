"""runners: real training steps that measure memory, to check the planner against.

This package grows with the "Runner" issue (subprocess isolation, CUDA and simulated
modes, run history); today it builds models, batches and optimizers exactly as a
training run would, and measures one steady-state step on CPU with torch's MemTracker.
"""
