"""runners: verification runs that measure memory, the planner's proof.

A run builds the model from its config (random weights), trains a few steps with the
lessons' Accelerate loop or transformers' Trainer (runners.engines), and measures the
last, steady-state step with a memory probe (runners.probes: MemTracker on real or fake
tensors, or the CUDA allocator). runners.verify runs it in a child process
(runners.isolation, runners.child) and records it in SQLite (runners.history);
`python -m runners verify` is the command line.
"""
