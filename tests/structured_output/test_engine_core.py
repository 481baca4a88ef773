"""The StructuredOutputManager inside an EngineCore (hash-logits model, real xgrammar): requests wait for their
grammar without blocking others, a grammar that fails to compile (or a token it rejects) ends only its request,
streaming sessions restart or drop the constraint per chunk, and the backends compile and validate."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from kvflow import StructuredOutputsParams
from kvflow.config import StructuredOutputsConfig
from kvflow.core.sched.output import ModelRunnerOutput
from kvflow.engine.core import EngineCore
from kvflow.models.hash_model import hash_grammar_stop_token_id
from kvflow.request import Request, RequestStatus
from kvflow.sampling_params import SamplingParams
from kvflow.structured_output.backend import GrammarVocab, allocate_bitmask
from kvflow.structured_output.backend_xgrammar import XgrammarBackend
from kvflow.structured_output.manager import COMPILE_WORKERS, StructuredOutputManager
from kvflow.structured_output.setup import _hash_vocab
from kvflow.structured_output.validation import validate_structured_outputs
from kvflow.testing.hash_model import reference_tokens
from tests.engine.engine_simulation import BOUNDED, constrained_reference, make_engine_core


def _request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 10,
    constraint: StructuredOutputsParams | None = BOUNDED,
    resumable: bool = False,
) -> Request:
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=constraint
    )
    return Request(request_id, prompt, params, eos_token_id=50256, resumable=resumable)


def _run(core: EngineCore, max_steps: int = 500) -> dict[str, tuple[list[int], str | None, object]]:
    """Step until idle; per request: its tokens, finish reason and stop reason."""
    results: dict[str, tuple[list[int], str | None, object]] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return results
        for output in core.step():
            tokens, _, _ = results.get(output.request_id, ([], None, None))
            results[output.request_id] = (
                tokens + output.new_token_ids,
                output.finish_reason,
                output.stop_reason,
            )
    raise AssertionError("the engine did not go idle")


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def core(request: pytest.FixtureRequest):
    engine = make_engine_core(async_scheduling=request.param, model="hash-logits", num_blocks=200)
    yield engine
    engine.shutdown()


def test_a_compiling_grammar_holds_only_its_request(core: EngineCore) -> None:
    """While one constraint compiles (its vocabulary is held back here), its request waits in WAITING_FOR_FSM and
    an unconstrained request behind it runs to completion; then the constrained one runs exactly."""
    release = threading.Event()
    vocab = _hash_vocab(50256)

    def slow_vocab() -> GrammarVocab:
        release.wait(60)
        return vocab

    manager = StructuredOutputManager(StructuredOutputsConfig(), slow_vocab, 50256)
    core.structured_output_manager = manager
    core.add_request(_request("constrained", [5, 6, 7]))
    core.add_request(_request("plain", [8, 9], constraint=None))
    assert core.scheduler.requests["constrained"].status == RequestStatus.WAITING_FOR_FSM
    plain: list[int] = []
    for _ in range(200):
        for output in core.step():
            assert output.request_id == "plain"
            plain += output.new_token_ids
        if len(plain) == 10:
            break
    assert plain == reference_tokens([8, 9], 10)
    assert core.scheduler.requests["constrained"].status == RequestStatus.WAITING_FOR_FSM
    release.set()
    results = _run(core)
    assert results["constrained"][0] == constrained_reference([5, 6, 7], 10, "bounded")
    assert results["constrained"][1] == "stop"
    manager.shutdown()


def test_a_grammar_that_fails_to_compile_ends_only_its_request(core: EngineCore) -> None:
    """An invalid regex that slipped past the front end's validation: finish_reason "error" naming the field; the
    engine and the other requests go on."""
    core.add_request(_request("bad", [1, 2], constraint=StructuredOutputsParams(regex="a(")))
    core.add_request(_request("good", [3, 4]))
    core.add_request(_request("plain", [5], constraint=None))
    results = _run(core)
    tokens, finish_reason, stop_reason = results["bad"]
    assert tokens == [] and finish_reason == "error"
    assert "structured_outputs.regex" in str(stop_reason)
    assert results["good"][0] == constrained_reference([3, 4], 10, "bounded")
    assert results["plain"][0] == reference_tokens([5], 10)


def test_a_token_the_grammar_rejects_ends_the_request_with_an_error() -> None:
    """A sampled token the grammar forbids (the request's own controls forbade every token it allows, or the
    grammar allows none) ends that request with "error" as the request's fault, instead of advancing its matcher
    silently."""
    core = make_engine_core(model="hash-logits", num_blocks=200)
    try:
        core.add_request(_request("r", [1, 2, 3]))
        manager = core.structured_output_manager
        assert manager is not None
        manager._compile(BOUNDED).result()
        assert manager.poll() == []
        scheduler = core.scheduler
        output = scheduler.schedule()  # r's prefill, which samples
        assert output.has_structured_output_requests
        odd_token = 1  # BOUNDED's first token must be even
        runner_output = ModelRunnerOutput(
            req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[odd_token]]
        )
        outputs = {o.request_id: o for o in scheduler.update_from_output(output, runner_output)}
        assert outputs["r"].finish_reason == "error" and outputs["r"].client_error
        assert str(outputs["r"].stop_reason) == (
            "structured_outputs: the constraint allows no token after 0 output tokens: no token of the model's "
            "vocabulary continues it (a grammar without a finite string, such as `root ::= root`, or text the "
            "vocabulary cannot spell from here); token 1 was sampled unconstrained"
        )
    finally:
        core.shutdown()


def test_streaming_session_restarts_or_drops_the_constraint_per_chunk(core: EngineCore) -> None:
    """Chunk 1 constrained; chunk 2 repeats the constraint (a fresh continuation under it, after the new prompt);
    chunk 3 asks for none (unconstrained); a chunk with another constraint is refused."""
    core.add_request(_request("s", [11, 12], max_tokens=6, resumable=True))
    results = _run(core)
    first = results["s"][0]
    assert first == constrained_reference([11, 12], 6, "bounded")
    prompt2 = [11, 12, *first[:-1], 40, 41]
    core.add_request(_request("s", [40, 41], max_tokens=6, resumable=True))
    second = _run(core)["s"][0]
    assert second == constrained_reference(prompt2, 6, "bounded")
    other = StructuredOutputsParams(regex="a[0-9]+")
    with pytest.raises(ValueError, match="structured_outputs"):
        core.add_request(_request("s", [50], constraint=other, resumable=True))
    prompt3 = [*prompt2, *second[:-1], 50]
    core.add_request(_request("s", [50], max_tokens=5, constraint=None))
    third = _run(core)["s"][0]
    assert third == reference_tokens(prompt3, 5)


def test_the_hash_model_without_logits_refuses_a_constraint() -> None:
    core = make_engine_core(model="hash", num_blocks=50)
    try:
        with pytest.raises(ValueError, match=r"structured_outputs.*no logits"):
            core.add_request(_request("r", [1, 2]))
    finally:
        core.shutdown()


def test_guidance_on_the_hash_logits_model_is_a_request_error() -> None:
    core = make_engine_core(
        model="hash-logits", num_blocks=50, structured_outputs_backend="guidance"
    )
    try:
        core.add_request(_request("r", [1, 2]))
        _, finish_reason, stop_reason = _run(core)["r"]
        assert finish_reason == "error" and "needs the model's tokenizer" in str(stop_reason)
    finally:
        core.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance", "auto"])
@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (StructuredOutputsParams(regex="a("), "structured_outputs.regex"),
        (StructuredOutputsParams(json={"type": "objec"}), "structured_outputs.json"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
        (StructuredOutputsParams(grammar="root ::= missing"), "structured_outputs.grammar"),
    ],
)
def test_validation_names_the_field(
    backend: str, constraint: StructuredOutputsParams, field: str
) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        validate_structured_outputs(constraint, StructuredOutputsConfig(backend=backend))


def test_auto_falls_back_to_guidance_for_what_xgrammar_cannot_parse() -> None:
    lark = StructuredOutputsParams(grammar='start: "yes" | "no"')
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar"):
        validate_structured_outputs(lark, StructuredOutputsConfig(backend="xgrammar"))
    validate_structured_outputs(lark, StructuredOutputsConfig(backend="guidance"))
    validate_structured_outputs(lark, StructuredOutputsConfig(backend="auto"))


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "integer", "not": {"const": 3}}, "'not' at #"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "'allOf' of 2 subschemas at #"),
        (
            {
                "type": "object",
                "properties": {"x": {"type": "array", "items": {"if": {}, "then": {}}}},
            },
            "'if' at #/properties/x/items",
        ),
        ({"$defs": {"d": {"dependentRequired": {"a": ["b"]}}}}, "'dependentRequired' at #/$defs/d"),
        (
            {"anyOf": [{"type": "null"}, {"dependentSchemas": {}}]},
            "'dependentSchemas' at #/anyOf/1",
        ),
    ],
)
def test_xgrammar_refuses_keywords_it_would_not_enforce(schema: dict, named: str) -> None:
    """xgrammar 0.2 parses these keywords and ignores them (a value violating each passes its grammar): the
    xgrammar backend refuses the schema naming the keyword and where it is; "auto" tries guidance, whose reason
    joins the message when it refuses too."""
    constraint = StructuredOutputsParams(json=schema)
    with pytest.raises(ValueError, match=r"structured_outputs\.json uses " + re.escape(named)):
        validate_structured_outputs(constraint, StructuredOutputsConfig(backend="xgrammar"))
    try:
        validate_structured_outputs(constraint, StructuredOutputsConfig(backend="auto"))
    except ValueError as error:
        assert named in str(error) and "the guidance backend: " in str(error)


def test_keyword_names_as_property_names_or_values_are_no_keywords() -> None:
    schema = {
        "type": "object",
        "properties": {"not": {"type": "integer"}, "if": {"enum": ["not", "allOf"]}},
        "allOf": [{"required": ["not"]}],
    }
    validate_structured_outputs(
        StructuredOutputsParams(json=schema), StructuredOutputsConfig(backend="xgrammar")
    )


def test_a_compile_past_its_timeout_ends_only_its_request() -> None:
    """50,000 choices compile for seconds on the hash vocabulary (4 s on a 2-core EPYC, more on a busy machine);
    with compile_timeout_s 0.3 that request ends with "error" as the request's own fault (the API answers 400),
    while a small constraint beside it (milliseconds) compiles and runs to its end. The pool keeps a thread for the
    small one."""
    config = StructuredOutputsConfig(compile_timeout_s=0.3, max_choices=100_000)
    core = make_engine_core(model="hash-logits", num_blocks=200, structured_outputs_config=config)
    try:
        slow = StructuredOutputsParams(choice=[f"a{i}b" for i in range(50_000)])
        core.add_request(_request("slow", [1, 2], constraint=slow))
        core.add_request(_request("small", [3, 4]))
        finished = {}
        for _ in range(10_000):
            for output in core.step():
                if output.finished:
                    finished[output.request_id] = output
            if len(finished) == 2:
                break
        failed = finished["slow"]
        assert failed.finish_reason == "error" and failed.client_error
        assert "structured_outputs.choice did not compile within 0.3 s" in str(failed.stop_reason)
        assert finished["small"].finish_reason in ("stop", "length")
        assert not finished["small"].client_error
    finally:
        core.shutdown()


def test_distinct_constraints_leave_nothing_in_xgrammars_own_cache() -> None:
    """The manager's bounded cache is the only one: xgrammar's (unbounded by default) stays empty however many
    distinct constraints compile, so a client sending a new constraint each time cannot grow the engine."""
    backend = XgrammarBackend(_hash_vocab(64))
    for index in range(5):
        compiled = backend.compile(StructuredOutputsParams(regex=f"(a{index}|b{index})+"))
        assert compiled() is not None
    assert backend.compiler.get_cache_size_bytes() == 0


def test_a_request_that_leaves_before_its_compile_starts_cancels_it() -> None:
    """With every compile thread busy, a queued compile whose only request is aborted is cancelled and leaves the
    cache (a later request with the same constraint compiles it afresh)."""
    manager = StructuredOutputManager(
        StructuredOutputsConfig(max_choices=50_000), lambda: _hash_vocab(64), vocab_size=64
    )
    release = threading.Event()
    blockers = [manager._pool_submit(release.wait) for _ in range(COMPILE_WORKERS)]
    try:
        queued = _request("queued", [1, 2])
        manager.grammar_init(queued)
        future = queued.structured_output_request.compiled
        assert not future.done()
        queued.status = RequestStatus.FINISHED_ABORTED
        assert manager.poll() == []
        assert future.cancelled() and not manager.has_compiling()
        assert BOUNDED.cache_key() not in manager._compiled
    finally:
        release.set()
        for blocker in blockers:
            blocker.result(10)
        manager.shutdown()


def test_the_first_constraint_does_not_pay_for_loading_the_vocabulary() -> None:
    """compile_timeout_s bounds compiling, not the one-time vocabulary load at the first constrained request
    (seconds for a real tokenizer): a request that arrives while the vocabulary loads for three timeouts is not
    ended for it, and starts once its constraint compiles (milliseconds: the 0.5 s timeout is far off even on a
    busy machine)."""
    vocab_may_load = threading.Event()
    vocab_loading = threading.Event()

    def slow_vocab() -> GrammarVocab:
        vocab_loading.set()
        assert vocab_may_load.wait(60), "the test never let the vocabulary load"
        return _hash_vocab(64)

    manager = StructuredOutputManager(
        StructuredOutputsConfig(compile_timeout_s=0.5), slow_vocab, vocab_size=64
    )
    try:
        first = _request("first", [1, 2])
        manager.grammar_init(first)
        assert vocab_loading.wait(60), "the compile never started loading the vocabulary"
        second = _request("second", [3, 4], constraint=StructuredOutputsParams(regex="a2(b3)?"))
        manager.grammar_init(second)  # arrives during the load: it does not pay for it either
        loading_since = time.monotonic()
        while time.monotonic() < loading_since + 1.5:  # three timeouts of loading
            assert manager.poll() == []
            manager.wait_for_compile(0.05)  # returns at its timeout: nothing can compile yet
        vocab_may_load.set()
        deadline = time.monotonic() + 60
        while first.status != RequestStatus.WAITING or second.status != RequestStatus.WAITING:
            assert time.monotonic() < deadline, (
                "the constraints never compiled after the vocabulary loaded"
            )
            assert manager.poll() == []
            manager.wait_for_compile(0.1)
    finally:
        vocab_may_load.set()
        manager.shutdown()


@pytest.mark.parametrize(
    ("limits", "constraint", "message"),
    [
        (
            {"max_choices": 3},
            StructuredOutputsParams(choice=["a", "b", "c", "d"]),
            "has 4 choices.*max_choices: 3",
        ),
        (
            {"max_alternatives": 2},
            StructuredOutputsParams(regex="a|b|c"),
            "regex has 3 alternatives",
        ),
        (
            {"max_alternatives": 2},
            StructuredOutputsParams(grammar='root ::= "a" | "b" | "c"'),
            "grammar has 3",
        ),
        (
            {"max_alternatives": 2},
            StructuredOutputsParams(
                json={"type": "object", "properties": {"x": {"enum": [1, 2, 3]}}}
            ),
            "json has 3 alternatives",
        ),
        (
            {"max_constraint_chars": 10},
            StructuredOutputsParams(regex="a" * 11),
            "11 characters.*chars: 10",
        ),
        (
            {"max_constraint_chars": 10},
            StructuredOutputsParams(choice=["abcdef", "ghijk"]),
            "11 characters",
        ),
    ],
)
def test_each_compile_limit_refuses_what_exceeds_it(
    limits: dict, constraint: StructuredOutputsParams, message: str
) -> None:
    """Counted before anything is queued; the same constraint passes with the default limits."""
    with pytest.raises(ValueError, match=message):
        validate_structured_outputs(constraint, StructuredOutputsConfig(**limits))
    validate_structured_outputs(constraint, StructuredOutputsConfig())


@pytest.mark.parametrize(
    "option",
    [
        {"max_choices": 0},
        {"max_alternatives": "9"},
        {"max_constraint_chars": True},
        {"compile_timeout_s": 0},
        {"compile_timeout_s": float("inf")},
    ],
)
def test_bad_compile_limits_are_refused_naming_them(option: dict) -> None:
    [name] = option
    with pytest.raises(ValueError, match=f"structured_outputs_config {name} must be"):
        StructuredOutputsConfig.from_option(option)


def test_exactly_one_constraint_is_required() -> None:
    with pytest.raises(ValueError, match=r"exactly one of .*got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"StructuredOutputsParams\.choice"):
        StructuredOutputsParams(choice=[])


def test_the_bitmask_of_a_matcher_allows_exactly_the_grammar_tokens() -> None:
    """The synthetic vocabulary's bitmask: at the start of BOUNDED only even ids (not the stop token), after an
    even one only odd ids, after a pair odd... and the stop token."""
    manager = StructuredOutputManager(
        StructuredOutputsConfig(), lambda: _hash_vocab(64), vocab_size=64
    )
    factory = manager._compile(BOUNDED).result()
    grammar = factory()

    def allowed() -> set[int]:
        bitmask = allocate_bitmask(1, 64)
        bitmask[:] = 0
        grammar.fill_bitmask(bitmask, 0)
        bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:64]
        return {int(i) for i in np.flatnonzero(bits)}

    stop = hash_grammar_stop_token_id(64)
    assert allowed() == set(range(0, 64, 2))
    assert grammar.accept_tokens([4])
    assert allowed() == set(range(1, 63, 2))
    assert not grammar.accept_tokens([6])  # rejected, state unchanged
    assert grammar.accept_tokens([7])
    assert allowed() == set(range(0, 64, 2)) | {stop}
    assert grammar.accept_tokens([stop]) and grammar.is_terminated()
    manager.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tensor_parallel_workers_sample_under_the_grammar(async_scheduling: bool) -> None:
    """Two mp worker processes: every rank gets the step's bitmask (`SampleTokens`) after its forward pass, and
    the constrained outputs are the single-process ones."""
    from kvflow import LLM

    llm = LLM(
        "hash-logits",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        num_kv_blocks=300,
        max_model_len=256,
        async_scheduling=async_scheduling,
    )
    try:
        prompts = [[i + 1, 2 * i + 5, 9] for i in range(4)]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=10,
                ignore_eos=True,
                structured_outputs=BOUNDED if i % 2 == 0 else None,
            )
            for i in range(4)
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            expected = (
                constrained_reference(prompt, 10, "bounded")
                if i % 2 == 0
                else reference_tokens(prompt, 10)
            )
            assert list(output.outputs[0].token_ids) == expected
    finally:
        llm.shutdown()
