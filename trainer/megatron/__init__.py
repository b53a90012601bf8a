"""actor.backend=megatron (EXPERIMENTAL): HF <-> megatron-core conversion (convert.py) and the trainer-facing model (backend.py)."""
