"""Many prompts through one engine: the job runner, prompt and result files, Ray workers."""
