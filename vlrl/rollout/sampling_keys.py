"""The sampling settings a generation call may override (validation's `val_override_config`,
ReMax's greedy pass, the trainer's per-step seed). Kept free of heavy imports: the config checks
read it at start-up."""

SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "seed", "ignore_eos", "max_tokens")
