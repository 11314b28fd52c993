"""colibri-convert: Hugging Face safetensors checkpoint -> Colibri pack."""
