"""The default models' tokenizer: byte-level BPE with ChatML special tokens, trained on the spot with `tokenizers`.

Used by the training script (`tools/train_default_model.py`) for the shipped model and by the random-weight builder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
EOS_TOKEN = (
    IM_END_TOKEN  # end of an assistant turn; END_OF_TEXT_TOKEN also stops (generation_config.json)
)

# ChatML, with tools the way Qwen2.5's template has them: with `tools`, the system turn (the system message's text,
# if any) lists them as JSON inside <tools></tools> and says to call them as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the `hermes` tool parser reads that); an assistant turn's
# `tool_calls` render in the same form, and consecutive `tool` messages become one user turn of
# <tool_response>...</tool_response> blocks. Without tools the text is plain ChatML, as before.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages and messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}\n"
    "    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' }}{{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '\n"
    "        'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'\n"
    '        \'{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}\n'
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "        {{- raise_exception('unsupported role ' ~ message['role'] ~ ': use system, user, assistant or tool') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'system' and not loop.first %}\n"
    "        {{- raise_exception('a system message must come first') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['content'] is string %}\n"
    "        {%- set content = message['content'] %}\n"
    "    {%- else %}\n"
    "        {%- set content = namespace(text='') %}\n"
    "        {%- for part in message['content'] %}\n"
    "            {%- if part['type'] == 'text' %}{%- set content.text = content.text + part['text'] %}{%- endif %}\n"
    "        {%- endfor %}\n"
    "        {%- set content = content.text %}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'tool' %}\n"
    "        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}\n"
    "        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' and message['tool_calls'] %}\n"
    "        {{- '<|im_start|>assistant' }}\n"
    "        {%- if content %}{{- '\\n' + content }}{%- endif %}\n"
    "        {%- for tool_call in message['tool_calls'] %}\n"
    "            {%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}\n"
    "            {{- tool_call['arguments'] | tojson }}{{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif not (message['role'] == 'system' and tools) %}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Train a byte-level BPE tokenizer of `vocab_size` entries on `texts`: every one of the 256 bytes, merges,
    then the special tokens (`SPECIAL_TOKENS`, in that order, last). The post-processor adds BOS, as Llama 3's
    does. A corpus too small for the vocabulary is a RuntimeError."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    num_bpe_tokens = vocab_size - len(SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_bpe_tokens,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    trained = tokenizer.get_vocab_size(with_added_tokens=True)
    if trained != num_bpe_tokens:
        raise RuntimeError(
            f"the tokenizer has {trained} BPE tokens, expected {num_bpe_tokens}: "
            "the corpus is too small for the requested vocabulary"
        )
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def tokenizer_config(special_ids: dict[str, int], model_max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json` for a tokenizer from `train_tokenizer`: BOS added, ChatML template, EOS
    `<|im_end|>`, pad `<|end_of_text|>`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": END_OF_TEXT_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token, token_id in special_ids.items()
        },
        "chat_template": CHAT_TEMPLATE,
    }
