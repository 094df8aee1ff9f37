"""The deepseek family: DeepSeek-V3 (multi-head latent attention, a mixture of experts with shared
experts and group-limited sigmoid routing, multi-token prediction); `model` is the flax model and
its family, `hf` its Hugging Face adapter (transformers' DeepseekV3ForCausalLM)."""
