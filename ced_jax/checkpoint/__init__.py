"""Reading checkpoints: the released HF layout (`mapping`, `hf_loader`) and `convert_weights` output."""
