"""Drop-ins with the names and meanings of the APIs RL frameworks use today (verl, Megatron)."""
