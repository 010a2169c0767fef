"""The probe: a model's memory over one training step, derived from the model's own code.

run.py executes the real step on fake tensors at reduced depth and three small sizes,
recorder.py writes down every allocation and free, solve.py turns the three recordings into
exact functions of batch, sequence and depth (a ProbeTable, table.py), and cache.py keeps
tables per (config, technique class, library versions), shipped for the catalog.
"""
