"""Training MTP drafters by self-distillation: the target answers prompts, the drafter learns
to predict the target's next tokens from the target's own hidden state and KV cache."""
