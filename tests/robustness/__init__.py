"""Robustness suites: hostile inputs, the hostile corpus, fuzzing, faults, soak, bad API use."""
