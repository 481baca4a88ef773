"""Structured outputs and logits controls through the official `openai` client against one real server on the
built-in default model, in vLLM's request shapes: OpenAI's `response_format`, vLLM's `structured_outputs` and the
older `guided_*` fields, `logit_bias`, `allowed_token_ids`, `bad_words` and `truncate_prompt_tokens`.

A bad request (two constraints, a schema, regex or grammar the backend cannot parse, a token id outside the
vocabulary, a bias outside [-100, 100], a per-request backend) is a 400 naming its field before anything is queued,
and the server goes on serving. A good one is followed: every choice, streamed or whole, parses and matches its
constraint (JSON Schema checked with `jsonschema`), and each logits control changes the tokens as it says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import openai
import pytest

from kvflow.default_model import ensure_default_model
from kvflow.model_info import resolve_model_info
from kvflow.tokenizer import Tokenizer, load_tokenizer
from tests.entrypoints.server import DEFAULT_SERVER, RemoteServer, running_server

MODEL = "default"
MESSAGES = [{"role": "user", "content": "Describe a user of this service."}]
PROMPT = "The user of this service is"
# Enough for every constraint below to close: each is bounded (maxLength, maxItems, enums, integer ranges); the
# longest of 45 sampled SCHEMA outputs took 139 tokens.
MAX_TOKENS = 300
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["new", "vip", "beta"]},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "blue"]
REGEX = r"[0-9]{3}-[a-z]{2,5}"
# xgrammar's EBNF; GRAMMAR_REGEX is the same language, to check outputs with.
GRAMMAR = """
root ::= answer " because " reason "."
answer ::= "yes" | "no" | "maybe"
reason ::= word | word " " word
word ::= [a-z] | [a-z] [a-z] | [a-z] [a-z] [a-z]
"""
GRAMMAR_REGEX = r"(yes|no|maybe) because [a-z]{1,3}( [a-z]{1,3})?\."


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with running_server(*DEFAULT_SERVER) as remote:
        yield remote


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(ensure_default_model())


@pytest.fixture(scope="module")
def vocab_size() -> int:
    return resolve_model_info(None).vocab_size


def create(
    client: openai.OpenAI, endpoint: str, *, stream: bool = False, **fields: Any
) -> list[tuple[str, str | None]]:
    """`(text, finish_reason)` of each choice of one request to `endpoint` ("chat" or "completions"), in index
    order; a stream's deltas are joined. `fields` go in the body (OpenAI's own ones as arguments for chat)."""
    fields = {"temperature": 0, "max_tokens": MAX_TOKENS, **fields}
    official = {"n", "temperature", "max_tokens", "seed", "logit_bias"}
    if endpoint == "chat":
        official.add("response_format")
    arguments = {name: fields.pop(name) for name in list(fields) if name in official}
    if endpoint == "chat":
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=stream, extra_body=fields, **arguments
        )
    else:
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, stream=stream, extra_body=fields, **arguments
        )
    texts: dict[int, str] = {}
    finish_reasons: dict[int, str | None] = {}
    for chunk in response if stream else [response]:
        for choice in chunk.choices:
            piece = _piece(choice, endpoint, stream)
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason is not None:
                finish_reasons[choice.index] = choice.finish_reason
    return [(texts[index], finish_reasons.get(index)) for index in sorted(texts)]


def _piece(choice: Any, endpoint: str, stream: bool) -> str | None:
    if endpoint == "completions":
        return choice.text
    return choice.delta.content if stream else choice.message.content


def refused(client: openai.OpenAI, endpoint: str, **fields: Any) -> openai.BadRequestError:
    """The 400 a request with `fields` gets."""
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, endpoint, max_tokens=4, **fields)
    return caught.value


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": {"name": "user", "schema": schema, "strict": True},
    }


# ---------------------------------------------------------------------------------------------------- refused
TWO_CONSTRAINTS = [
    ("chat", {"response_format": json_schema_format(SCHEMA), "guided_regex": REGEX}),
    ("completions", {"structured_outputs": {"regex": REGEX, "choice": CHOICES}}),
    ("completions", {"guided_json": SCHEMA, "guided_choice": CHOICES}),
    ("chat", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": REGEX}}),
]


@pytest.mark.parametrize(("endpoint", "fields"), TWO_CONSTRAINTS)
def test_two_constraints_are_a_400_naming_both(
    client: openai.OpenAI, endpoint: str, fields: dict[str, Any]
) -> None:
    error = refused(client, endpoint, **fields)
    names = list(fields) if len(fields) == 2 else list(fields["structured_outputs"])
    for name in names:
        assert name in error.message, error.message
    assert error.param in fields


# Two subschemas that must both hold: xgrammar 0.2 would enforce only one of them, so this (default, xgrammar) server
# refuses it, and guidance (or "auto", tests/structured_output/test_llm_structured.py) compiles it.
ALL_OF_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]}, "age": {"enum": [30, 40]}},
    "additionalProperties": False,
    "allOf": [{"required": ["city"]}, {"required": ["age"]}],
}


def valid_all_of(text: str) -> None:
    value = json.loads(text)
    jsonschema.validate(value, ALL_OF_SCHEMA)
    assert set(value) == {"city", "age"}, value


INVALID_CONSTRAINTS = [
    (
        "chat",
        {
            "response_format": json_schema_format(
                {"type": "object", "properties": {"a": {"type": 7}}}
            )
        },
        "response_format",
    ),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format"),
    ("completions", {"structured_outputs": {"regex": "[a-z"}}, "structured_outputs"),
    ("chat", {"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"choise": CHOICES}}, "structured_outputs"),
    ("chat", {"guided_json": '{"type": "object",'}, "guided_json"),
    ("completions", {"guided_regex": "(unclosed"}, "guided_regex"),
    ("chat", {"guided_grammar": 'root ::= "a" |'}, "guided_grammar"),
    ("completions", {"guided_choice": []}, "guided_choice"),
    # Keywords xgrammar would ignore: a 400 naming the keyword, not a half-honoured schema.
    ("completions", {"guided_json": {"type": "integer", "not": {"const": 3}}}, "guided_json"),
    ("completions", {"structured_outputs": {"json": ALL_OF_SCHEMA}}, "structured_outputs"),
    # Past the default compile limits (max_choices 4096, max_constraint_chars 65536): refused before queueing.
    ("completions", {"guided_choice": [f"c{i}" for i in range(4097)]}, "guided_choice"),
    ("chat", {"guided_regex": "a" * 65537}, "guided_regex"),
    (
        "chat",
        {
            "response_format": json_schema_format(
                {"allOf": [{"type": "string"}, {"type": "integer"}]}
            )
        },
        "response_format",
    ),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), INVALID_CONSTRAINTS)
def test_an_invalid_constraint_is_a_400_naming_its_field(
    client: openai.OpenAI, endpoint: str, fields: dict[str, Any], param: str
) -> None:
    error = refused(client, endpoint, **fields)
    assert error.param == param, error.message
    assert param in error.message


def test_per_request_backends_other_than_the_servers_are_refused(client: openai.OpenAI) -> None:
    error = refused(client, "chat", guided_choice=CHOICES, guided_decoding_backend="guidance")
    assert error.param == "guided_decoding_backend"
    assert "--structured-outputs-config" in error.message
    error = refused(client, "completions", guided_regex=REGEX, guided_decoding_backend="outlines")
    assert error.param == "guided_decoding_backend"
    error = refused(client, "completions", guided_whitespace_pattern=r"[ ]?")
    assert error.param == "guided_whitespace_pattern"


@pytest.mark.parametrize(
    "logit_bias",
    [{"abc": 5}, {"1.5": 5}, {"7": 101}, {"7": -100.5}, {"-1": 5}, {"4096": 5}, {"99999999999": 5}],
)
def test_a_bad_logit_bias_is_a_400_naming_it(
    client: openai.OpenAI, logit_bias: dict[str, float]
) -> None:
    assert refused(client, "completions", logit_bias=logit_bias).param == "logit_bias"


def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_field(
    client: openai.OpenAI, vocab_size: int
) -> None:
    for allowed in ([vocab_size], [1, 2, vocab_size + 7], [-1], []):
        error = refused(client, "chat", allowed_token_ids=allowed)
        assert error.param == "allowed_token_ids", error.message
    error = refused(client, "completions", logit_bias={str(vocab_size): 1.0})
    assert error.param == "logit_bias" and str(vocab_size) in error.message
    assert refused(client, "chat", truncate_prompt_tokens=0).param == "truncate_prompt_tokens"
    assert refused(client, "completions", bad_words=[" "]).param == "bad_words"


def test_the_server_keeps_serving_after_refusals(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    for endpoint, fields in TWO_CONSTRAINTS:
        refused(client, endpoint, **fields)
    [(text, finish_reason)] = create(client, "chat", max_tokens=5)
    assert finish_reason in ("stop", "length")
    [(text, finish_reason)] = create(client, "completions", response_format={"type": "text"})
    assert text and finish_reason in ("stop", "length")
    assert server.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------------------- followed
def valid_json_schema(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def valid_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def valid_choice(text: str) -> None:
    assert text in CHOICES


def valid_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def valid_grammar(text: str) -> None:
    assert re.fullmatch(GRAMMAR_REGEX, text), text


# (id, endpoint, streamed, n, fields, check): each kind of constraint through each field that can set it, streamed
# and whole, on both endpoints; n=3 samples (seeded) where marked.
FOLLOWED: list[tuple[str, str, bool, int, dict[str, Any], Callable[[str], None]]] = [
    (
        "json_schema-response_format",
        "chat",
        False,
        1,
        {"response_format": json_schema_format(SCHEMA)},
        valid_json_schema,
    ),
    (
        "json_schema-structured_outputs",
        "completions",
        True,
        1,
        {"structured_outputs": {"json": SCHEMA}},
        valid_json_schema,
    ),
    ("json_schema-guided_json", "chat", True, 3, {"guided_json": SCHEMA}, valid_json_schema),
    (
        "json_object-response_format",
        "completions",
        False,
        1,
        {"response_format": {"type": "json_object"}},
        valid_json_object,
    ),
    (
        "json_object-structured_outputs",
        "chat",
        True,
        3,
        {"structured_outputs": {"json_object": True}},
        valid_json_object,
    ),
    (
        "choice-structured_outputs",
        "completions",
        False,
        3,
        {"structured_outputs": {"choice": CHOICES}},
        valid_choice,
    ),
    ("choice-guided_choice", "chat", True, 1, {"guided_choice": CHOICES}, valid_choice),
    (
        "regex-structured_outputs",
        "chat",
        False,
        1,
        {"structured_outputs": {"regex": REGEX}},
        valid_regex,
    ),
    ("regex-guided_regex", "completions", True, 3, {"guided_regex": REGEX}, valid_regex),
    (
        "grammar-structured_outputs",
        "completions",
        True,
        1,
        {"structured_outputs": {"grammar": GRAMMAR}},
        valid_grammar,
    ),
    ("grammar-guided_grammar", "chat", False, 3, {"guided_grammar": GRAMMAR}, valid_grammar),
    (
        "choice-guided_decoding_backend",
        "completions",
        False,
        1,
        {"guided_choice": CHOICES, "guided_decoding_backend": "xgrammar"},
        valid_choice,
    ),
]


@pytest.mark.parametrize(
    ("endpoint", "stream", "n", "fields", "check"),
    [case[1:] for case in FOLLOWED],
    ids=[case[0] for case in FOLLOWED],
)
def test_every_choice_follows_its_constraint(
    client: openai.OpenAI,
    endpoint: str,
    stream: bool,
    n: int,
    fields: dict[str, Any],
    check: Callable[[str], None],
) -> None:
    sampling = {"n": n, "temperature": 0.8, "seed": 7} if n > 1 else {}
    choices = create(client, endpoint, stream=stream, **sampling, **fields)
    assert len(choices) == n
    for text, finish_reason in choices:
        assert finish_reason == "stop", (text, finish_reason)  # the constraint completed, then EOS
        check(text)


def test_compact_json_without_whitespace(client: openai.OpenAI) -> None:
    fields = {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
    [(text, _)] = create(client, "completions", **fields)
    valid_json_schema(text)
    # No whitespace but, at most, one space after each separator (xgrammar writes ", " and ": ").
    value = json.loads(text)
    separators = [(",", ":"), (", ", ": ")]
    assert text in [json.dumps(value, separators=pair, ensure_ascii=False) for pair in separators]


# ---------------------------------------------------------------------------------------------------- logits
def completion_token_ids(client: openai.OpenAI, max_tokens: int, **fields: Any) -> list[int]:
    """The token ids of one greedy completion of PROMPT (no repetition penalty: only `fields` steer it)."""
    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=fields.pop("temperature", 0),
        seed=fields.pop("seed", None),
        logit_bias=fields.pop("logit_bias", None),
        extra_body={"return_token_ids": True, "repetition_penalty": 1.0, **fields},
    )
    return list(response.choices[0].token_ids)


def test_logit_bias_bans_and_forces_tokens(client: openai.OpenAI) -> None:
    [greedy] = completion_token_ids(client, 1)
    [banned] = completion_token_ids(client, 1, logit_bias={str(greedy): -100})
    assert banned != greedy
    forced = (greedy + 1) % 4000
    assert completion_token_ids(client, 4, logit_bias={str(forced): 100}) == [forced] * 4


def test_allowed_token_ids_are_the_only_ones_sampled(client: openai.OpenAI) -> None:
    allowed = {300, 301, 302, 303}
    token_ids = completion_token_ids(
        client, 12, temperature=1.0, seed=3, allowed_token_ids=sorted(allowed)
    )
    assert len(token_ids) == 12 and set(token_ids) <= allowed


def contains(token_ids: list[int], sequence: list[int]) -> bool:
    width = len(sequence)
    return any(token_ids[i : i + width] == sequence for i in range(len(token_ids) - width + 1))


def test_bad_words_are_never_completed(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    greedy = completion_token_ids(client, 16)
    # A word the greedy output spells as one token after a space: banning it must change the output.
    words = [
        tokenizer.decode([token_id]).strip()
        for token_id in greedy
        if re.fullmatch(r" [A-Za-z]+", tokenizer.decode([token_id]))
    ]
    assert words, tokenizer.decode(greedy)
    word = words[0]
    token_ids = completion_token_ids(client, 16, bad_words=[word])
    assert token_ids != greedy
    for text in (word, " " + word):
        assert not contains(token_ids, tokenizer.encode(text, add_special_tokens=False)), text


def test_truncate_prompt_tokens_keeps_the_last_k(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    prompt = " ".join(["the cache holds the keys and values"] * 6)
    full = tokenizer.encode(prompt)
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 7, "return_token_ids": True},
    )
    assert response.usage.prompt_tokens == 7
    assert response.choices[0].prompt_token_ids == full[-7:]
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"truncate_prompt_tokens": 9}
    )
    assert chat.usage.prompt_tokens == 9
    # Truncated before the length check: a prompt longer than max_model_len (1024) runs.
    too_long = client.completions.create(
        model=MODEL,
        prompt=[5] * 1100,
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 10},
    )
    assert too_long.usage.prompt_tokens == 10


# ---------------------------------------------------------------------------------------------- offline parity
def test_offline_llm_gives_the_same_tokens_as_the_server(client: openai.OpenAI) -> None:
    """`LLM.generate` with StructuredOutputsParams and the server with response_format: the same constrained
    greedy output (the server's generation-config defaults are set explicitly to kvflow's)."""
    from kvflow import LLM, SamplingParams, StructuredOutputsParams

    response = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "user", "schema": SCHEMA},
            },
            "repetition_penalty": 1.0,
            "return_token_ids": True,
        },
    )
    llm = LLM(max_model_len=1024, num_kv_blocks=256, max_num_seqs=4)
    try:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
        )
        offline = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert response.choices[0].text == offline.text
    jsonschema.validate(json.loads(offline.text), SCHEMA)


# ---------------------------------------------------------------------------------------------- guidance server
@pytest.fixture(scope="module")
def guidance_client() -> Iterator[openai.OpenAI]:
    config = json.dumps({"backend": "guidance"})
    with running_server(*DEFAULT_SERVER, "--structured-outputs-config", config) as remote:
        yield remote.client()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_guidance_backend_serves_schema_choice_and_lark(
    guidance_client: openai.OpenAI, stream: bool
) -> None:
    def chat(**extra_body: Any) -> list[str]:
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=5,
            n=2,
            extra_body=extra_body,
        )
        if not stream:
            return [
                c.message.content or ""
                for c in guidance_client.chat.completions.create(**kwargs).choices
            ]
        texts = ["", ""]
        for chunk in guidance_client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        return texts

    schema_format = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA}}
    for text in chat(response_format=schema_format):
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in chat(guided_choice=CHOICES):
        assert text in CHOICES
    for text in chat(response_format=json_schema_format(ALL_OF_SCHEMA)):
        valid_all_of(text)
    lark = 'start: ("yes" | "no") " because " /[a-z]{1,3}/ "."'
    for text in chat(structured_outputs={"grammar": lark}):
        assert re.fullmatch(r"(yes|no) because [a-z]{1,3}\.", text), text


# ---------------------------------------------------------------------------------------------- contradictions
CONTRADICTIONS = [
    ("min_tokens", {"guided_choice": ["a"], "min_tokens": 3}),
    ("bad_words", {"guided_choice": ["a"], "bad_words": ["a"]}),  # one byte: one way to write it
    ("allowed_token_ids", {"guided_choice": ["yes"], "allowed_token_ids": [0, 1, 2]}),
]


@pytest.mark.parametrize(
    ("field", "fields"), CONTRADICTIONS, ids=[case[0] for case in CONTRADICTIONS]
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_constraint_the_requests_own_controls_forbid_is_a_400_naming_them(
    server: RemoteServer, client: openai.OpenAI, endpoint: str, field: str, fields: dict[str, Any]
) -> None:
    """No token the constraint allows passes the request's own controls: the request contradicts itself, a 400
    naming the fields (one WARNING line in the log, no traceback), and the server goes on serving."""
    error = refused(client, endpoint, **fields)
    assert field in error.message and "structured_outputs" in error.message, error.message
    assert "contradicts itself" in error.message
    [(text, _)] = create(client, endpoint, guided_choice=CHOICES)
    assert text in CHOICES
    assert "Traceback" not in server.log


@pytest.mark.parametrize(
    ("field", "fields"), CONTRADICTIONS, ids=[case[0] for case in CONTRADICTIONS]
)
def test_contradictions_are_400s_on_the_guidance_backend_too(
    guidance_client: openai.OpenAI, field: str, fields: dict[str, Any]
) -> None:
    error = refused(guidance_client, "completions", **fields)
    assert field in error.message and "contradicts itself" in error.message, error.message


def test_a_grammar_without_a_finite_string_is_a_400(
    server: RemoteServer, client: openai.OpenAI
) -> None:
    """xgrammar parses `root ::= root` and then allows no token: the request's fault, a 400 naming it."""
    error = refused(client, "completions", structured_outputs={"grammar": "root ::= root"})
    assert (
        "structured_outputs: the constraint allows no token after 0 output tokens" in error.message
    )
    assert "Traceback" not in server.log


@pytest.mark.parametrize(
    "constraint",
    [
        {"grammar": "start: start"},
        {"json": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
    ],
    ids=["lark-loop", "ref-loop"],
)
def test_guidance_s_own_reason_reaches_the_client(
    guidance_client: openai.OpenAI, constraint: dict[str, Any]
) -> None:
    """A constraint llguidance's matcher fails on at its first token: a 400 carrying llguidance's reason."""
    error = refused(guidance_client, "completions", structured_outputs=constraint)
    assert (
        "structured_outputs: the backend's matcher failed after 0 output tokens: " in error.message
    )
    assert "NoExtensionBias" in error.message, error.message


# ------------------------------------------------------------------------------------------- compile timeout
def test_a_constraint_that_outlives_the_compile_timeout_is_a_400_and_others_are_served() -> None:
    """`--structured-outputs-compile-timeout 0.3` with the size limits raised: 50,000 choices compile for seconds
    on the hash-logits vocabulary (2.9 s on a 2-core EPYC), so that request is a 400 naming its field (one WARNING
    line, no traceback), while a small constraint sent beside it is served."""
    options = json.dumps({"max_choices": 100_000, "max_constraint_chars": 1_000_000})
    with running_server(
        "hash-logits",
        "--structured-outputs-compile-timeout",
        "0.3",
        "--structured-outputs-config",
        options,
    ) as server:
        slow = {"structured_outputs": {"choice": [f"a{i}b" for i in range(50_000)]}}
        small = {"structured_outputs": {"regex": "(a[0-9]+b[0-9]+){1,3}"}, "ignore_eos": True}
        with server.http() as http:
            refused = http.post(
                "/v1/completions",
                json={"model": "hash-logits", "prompt": [1, 2, 3], "max_tokens": 8, **slow},
            )
            served = http.post(
                "/v1/completions",
                json={"model": "hash-logits", "prompt": [4, 5], "max_tokens": 8, **small},
            )
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "structured_outputs.choice did not compile within 0.3 s" in message, message
        assert served.status_code == 200, served.text
        assert "Traceback" not in server.log
