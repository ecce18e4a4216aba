"""Mixture-of-Experts components: static-capacity dispatcher, grouped experts, PipelinedLLEP."""
