"""The gemma family: Gemma 3's text decoder (runner.models.gemma.model) and its Hugging Face
adapter for Gemma3ForCausalLM (runner.models.gemma.hf)."""
