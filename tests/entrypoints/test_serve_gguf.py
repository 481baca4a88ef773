"""`kvflow serve model.gguf --tokenizer FOLDER` (vLLM's form), checked with the official `openai` client against
the in-process `LLM` on the same file: the server runs the quantized file, not a float copy of the checkpoint. A
file from `tools/convert_to_gguf.py` serves alone (its tokenizer and chat template are inside it)."""

from __future__ import annotations

from pathlib import Path

from kvflow import LLM, SamplingParams
from kvflow.default_model import ensure_default_model
from kvflow.models.quantization.gguf_writer import write_gguf
from tests.entrypoints.server import DEFAULT_SERVER, running_server
from tools.convert_to_gguf import convert

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story about a cat."}]


def test_serving_a_q4_k_m_file_matches_llm_on_it(tmp_path: Path) -> None:
    model_dir = ensure_default_model()
    path = write_gguf(model_dir, tmp_path / "default-Q4_K_M.gguf", "Q4_K_M")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    options = {"max_model_len": 1024, "num_kv_blocks": 256, "max_num_seqs": 4}
    reference = LLM(str(path), tokenizer=str(model_dir), disable_log_stats=True, **options)
    try:
        expected = reference.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    finally:
        reference.shutdown()
    with running_server(str(path), "--tokenizer", str(model_dir), *DEFAULT_SERVER) as server:
        assert "GGUF weights kept in their blocks: 34 Q4_0, 4 Q4_K, 2 Q6_K, 2 Q8_0" in server.log
        client = server.client()
        [card] = client.models.list().data
        assert card.id == str(path)
        completion = client.completions.create(
            model=card.id,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert completion.choices[0].text == expected.text
        stream = client.completions.create(
            model=card.id,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(chunk.choices[0].text for chunk in stream) == expected.text


def test_a_converted_file_alone_in_a_folder_serves_as_its_checkpoint(tmp_path: Path) -> None:
    model_dir = ensure_default_model()
    alone = tmp_path / "alone"
    alone.mkdir()
    path = convert(
        model_dir, alone / "default-f32.gguf", dtype="f32"
    )  # the checkpoint's weights exactly
    assert [file.name for file in alone.iterdir()] == [path.name]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    options = {"max_model_len": 1024, "num_kv_blocks": 256, "max_num_seqs": 4}
    expected = None
    for model in (model_dir, path):
        llm = LLM(str(model), disable_log_stats=True, **options)
        try:
            [got] = llm.chat(MESSAGES, params, use_tqdm=False)
        finally:
            llm.shutdown()
        expected = expected or got
        assert got.prompt_token_ids == expected.prompt_token_ids
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert expected is not None and expected.outputs[0].text
    with running_server(str(path), *DEFAULT_SERVER) as server:
        client = server.client()
        [card] = client.models.list().data
        chat = client.chat.completions.create(
            model=card.id,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=16,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage is not None
        assert chat.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert chat.choices[0].message.content == expected.outputs[0].text
