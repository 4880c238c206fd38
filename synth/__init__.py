"""The environment factory: repositories in, verified (problem, environment, verifier) tasks out."""
