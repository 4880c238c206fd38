"""Docker sandboxes, agent tools, grading and the episode loop (no torch, no trainer code)."""
