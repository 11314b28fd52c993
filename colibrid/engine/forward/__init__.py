"""The forward pass: the model, its token mixers (attention, latent attention, Gated
DeltaNet), the MoE block, RoPE and the per-sequence state."""
