"""Random-weight decoders of real architectures, scaled down, with chat templates.

For tests and speed measurements of the engines on the architectures users deploy
(Llama, Qwen2, Mistral, GPT-2): the config is the architecture's own (its
``model_type``, attention layout, RoPE, norms), only smaller; the weights are random
(seeded); the tokenizer is a byte-level BPE trained here on the standard library's
docstrings, with the chat special tokens of the family and a chat template in
``tokenizer_config.json`` as the family's checkpoints carry one. Nothing is downloaded.

The templates are inferd's own renderings of the two layouts models use:

- ``chatml`` (Qwen2/2.5/3, many others): ``<|im_start|>role\\n…<|im_end|>``, tools
  listed in the system turn inside ``<tools></tools>``, calls answered as
  ``<tool_call>{"name": …, "arguments": …}</tool_call>`` (the "Hermes" convention vLLM's
  ``hermes`` parser reads);
- ``llama3``: ``<|start_header_id|>role<|end_header_id|>\\n\\n…<|eot_id|>``, the same
  tool conventions.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from inferd.demo.corpus import stdlib_corpus, train_bpe

CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call functions. Their signatures are in <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nFor each call answer <tool_call>{\"name\": <name>, \"arguments\": "
    "<arguments>}</tool_call>.<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + "
    "(call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)  # fmt: skip

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'You may call functions:' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\nFor each call answer <tool_call>{\"name\": <name>, \"arguments\": "
    "<arguments>}</tool_call>.<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' + "
    "(call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}{%- else %}{{- message['content'] }}{%- endif %}"
    "{{- '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)  # fmt: skip

_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
        "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", "template": CHATML_TEMPLATE,
        "config": {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
            "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
            "attention_dropout": 0.0,
        },
    },
    "llama": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                     "<|end_header_id|>", "<|eot_id|>", "<tool_call>", "</tool_call>"],
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": "<|end_of_text|>",
        "template": LLAMA3_TEMPLATE,
        "config": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "attention_bias": False,
            "mlp_bias": False, "attention_dropout": 0.0, "head_dim": 32,
        },
    },
    "mistral": {
        "specials": ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
        "bos": "<s>", "eos": "<|im_end|>", "pad": "</s>", "template": CHATML_TEMPLATE,
        "config": {
            "architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "hidden_act": "silu", "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "sliding_window": None, "attention_dropout": 0.0, "head_dim": 32,
        },
    },
}  # fmt: skip
FAMILIES = tuple(_FAMILIES)


def random_decoder(
    out_dir: Path,
    family: str = "qwen2",
    *,
    layers: int = 2,
    hidden: int = 128,
    intermediate: int = 256,
    vocab: int = 2048,
    context: int = 1024,
    seed: int = 0,
    name: str | None = None,
) -> Path:
    """A ``family``-shaped decoder (``qwen2``, ``llama``, ``mistral``) with random
    weights in ``out_dir/<name>`` (default ``<family>-random``), replaced if present:
    config.json, model.safetensors, generation_config.json, tokenizer.json and
    tokenizer_config.json with the family's chat template."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    spec = _FAMILIES[family]
    folder = Path(out_dir) / (name or f"{family}-random")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    specials = spec["specials"]
    bpe = train_bpe(stdlib_corpus().paragraphs, vocab - len(specials) + 1)
    bpe.add_special_tokens(specials[1:])  # train_bpe added <|endoftext|> as the last id
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        model_max_length=context,
        eos_token=spec["eos"],
        pad_token=spec["pad"],
        bos_token=spec["bos"],
        additional_special_tokens=[
            t for t in specials if t not in (spec["eos"], spec["pad"], spec["bos"])
        ],
    )
    tokenizer.chat_template = spec["template"]
    tokenizer.save_pretrained(folder)
    vocab_size = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(spec["eos"])
    bos_id = tokenizer.convert_tokens_to_ids(spec["bos"]) if spec["bos"] else eos_id
    config = AutoConfig.for_model(
        **spec["config"],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        max_position_embeddings=context,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random weights large enough that greedy picks are not ties
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos_id
    model.save_pretrained(folder, safe_serialization=True)
    return folder
