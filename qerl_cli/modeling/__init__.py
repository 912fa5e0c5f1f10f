"""Model pieces: 4-bit QuantLinear, checkpoint loading, LoRA, AQN, tiny and random-weight models."""
