"""The DeepSeek-V4.1-Flash architecture as single-device PyTorch (no Ray, Hydra or distributed code)."""
