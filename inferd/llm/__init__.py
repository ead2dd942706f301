"""The LLM engine: continuous batching over a paged KV cache, GPT-2 family, multi-LoRA.

No HTTP imports here: the replica drives :class:`inferd.llm.engine.LLMEngine` and the
gateway only ever sees token frames.
"""
