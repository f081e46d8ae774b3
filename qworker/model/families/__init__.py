"""One module per model family: each reads a Hugging Face config into a ModelConfig, naming the
parts (norms, MLP or MoE, attention extras, windows, RoPE) its models are made of."""
