"""Trainers (SFT, RL, OPD), their Ray actors and the job entry points; the only package that wires all others."""
