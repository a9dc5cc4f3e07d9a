"""Exercise 7.2: incremental detokenization with stop strings. The learner's detokenizer and the
engine's ``SlowIncrementalDetokenizer`` run in an ``OutputProcessor`` on the same token streams
(every output must be the same), then in the real engine."""

from __future__ import annotations

import random

from minivllm.course.checks.common import ENGINE_PROMPTS, Exercise, check_engine
from minivllm.engine import detokenizer as detok
from minivllm.engine.messages import EngineCoreOutput
from minivllm.engine.output_processor import OutputProcessor
from minivllm.outputs import RequestOutputKind
from minivllm.sampling_params import SamplingParams

DETOKENIZER_ANSWER = tuple(f"minivllm.engine.detokenizer:{name}" for name in (
    "IncrementalDetokenizer", "SlowIncrementalDetokenizer", "FastIncrementalDetokenizer",
    "find_stop_string", "_tail", "default_detokenizer_cls"))
CONVENTION = ("Expected: update(new_token_ids) appends the tokens, decodes the window "
              "tokens[prefix_offset:] and tokens[prefix_offset:read_offset] (starting from the "
              "prompt's last 5 tokens), emits the difference unless the window decodes to "
              "nothing new or ends in '\\ufffd' (then the offsets stay), moves prefix_offset <- "
              "read_offset and read_offset <- len(tokens), appends the new text, and looks for "
              "a stop string where the new characters could complete one: the text is cut "
              "before it (after it with include_stop_str_in_output) and the stop string is "
              "returned. get_next_output_text(finished, delta) returns the text so far (delta: "
              "only what was not returned before) without its last max(len(stop)) - 1 "
              "characters while not finished (none held back with include_stop_str_in_output).")
TEXTS = [
    "Café crème, naïve façade: déjà vu! 日本語のテキストと絵文字 🤖🚀✨ mixed with ASCII.",
    "def area(r):\n    return 3.14159 * r ** 2  # π r²\n\nprint(area(2))",
    "Привет, мир! Ελληνικά κείμενα. עִבְרִית. 한국어 문장입니다. The end.",
    "Numbers 1234567890, symbols <>&\"' and spaces   between    words. Ünïcödé ëvérywhêrë.",
]
STORY = "Once upon a time there was a STOP sign and then nothing."
DELTA, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE
TARGETED = [  # (name, text, params): each after a one-token prompt, one token per step
    ("multi-byte characters split across tokens", " robots 🤖🚀 and 日本語",
     dict(output_kind=DELTA)),
    ("a stop string spanning tokens", STORY, dict(stop=["STOP sign"], output_kind=DELTA)),
    ("a stop string kept in the output", STORY,
     dict(stop=["STOP sign"], include_stop_str_in_output=True, output_kind=DELTA)),
    ("held-back text (a stop string that never completes)", STORY,
     dict(stop=["STOP light"], output_kind=CUMULATIVE)),
]
FIELDS = ("text", "finish_reason", "stop_reason", "finished", "requests to abort")


def _cases(tokenizer, seed: int):
    """(name, prompt ids, output ids, params, tokens per step): the targeted cases, then random
    ones, in turn a slice of a text, random ids, and a text with random ids spliced in."""
    cases = [(name, [1], tokenizer.encode(text), SamplingParams(**params), 1)
             for name, text, params in TARGETED]
    rng = random.Random(seed)
    for i in range(48):
        if i % 3 == 0:
            ids = tokenizer.encode(rng.choice(TEXTS))
            start = rng.randrange(0, max(1, len(ids) // 3))
            ids = ids[start:start + rng.randint(8, 40)]
        elif i % 3 == 1:
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(8, 30))]
        else:
            ids = tokenizer.encode(rng.choice(TEXTS))[: rng.randint(8, 30)]
            for _ in range(3):
                ids.insert(rng.randrange(len(ids)), rng.randrange(len(tokenizer)))
        decoded, stops = tokenizer.decode(ids), []
        if rng.random() < 0.7 and len(decoded) > 6:  # a stop string that occurs (often mid-token)
            a = rng.randrange(len(decoded) // 3, len(decoded) - 2)
            stops.append(decoded[a:a + rng.randint(2, 6)])
        if rng.random() < 0.4:
            stops.append(rng.choice(["\n\n", "END", " the", "🚀", "zzqx"]))
        params = SamplingParams(
            max_tokens=len(ids), stop=stops or None,
            include_stop_str_in_output=rng.random() < 0.3,
            skip_special_tokens=rng.random() < 0.8, output_kind=rng.choice(list(RequestOutputKind)))
        prompt = tokenizer.encode(rng.choice(TEXTS))[: rng.randint(1, 12)]
        step = 1 if rng.random() < 0.8 else rng.randint(2, 3)
        cases.append((f"stream {i}", prompt, ids, params, step))
    return cases


def _run(tokenizer, detokenizer_cls, case):
    """Feed one stream through an OutputProcessor: its outputs as plain tuples, and aborts."""
    name, prompt, ids, params, step = case
    processor = OutputProcessor(tokenizer, detokenizer_cls)
    processor.add_request("req", None, list(prompt), params, 0.0)
    trace = []
    for i in range(0, len(ids), step):
        out = EngineCoreOutput("req", ids[i:i + step],
                               finish_reason="length" if i + step >= len(ids) else None)
        outputs, to_abort = processor.process_outputs([out])
        trace += [(i, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
                   o.finished, tuple(to_abort)) for o in outputs]
        if not outputs and to_abort:
            trace.append((i, None, None, None, None, tuple(to_abort)))
        if not processor.has_unfinished_requests():
            break
    return trace


def check_detokenizer(detokenizer_cls, exercise: str = "7.2", seed: int = 0) -> None:
    """``detokenizer_cls(tokenizer, prompt_token_ids, params)`` with ``update`` and
    ``get_next_output_text``, as the engine's detokenizers."""
    ex = Exercise(exercise, CONVENTION, DETOKENIZER_ANSWER,
                  allowed="the tokenizer's decode and convert_ids_to_tokens")
    if not isinstance(detokenizer_cls, type):
        ex.fail(f"expected a class (detokenizer_cls(tokenizer, prompt_token_ids, params)), "
                f"got {detokenizer_cls!r}.")
    detokenizer_cls = ex.take(detokenizer_cls, "detokenizer")
    llm = check_engine()
    tokenizer = llm.get_tokenizer()  # the bundled model's
    cases = _cases(tokenizer, seed)
    for case in cases:
        name, _, ids, params, step = case
        where = (f"{name}: {len(ids)} tokens, {step} per step, stop={params.stop!r}, "
                 f"include_stop_str_in_output={params.include_stop_str_in_output}, "
                 f"skip_special_tokens={params.skip_special_tokens}, "
                 f"output_kind={params.output_kind.name}")
        want = _run(tokenizer, detok.SlowIncrementalDetokenizer, case)
        try:
            got = _run(tokenizer, detokenizer_cls, case)
        except (NotImplementedError, AssertionError):
            raise
        except Exception as e:
            ex.fail(f"{where}: your detokenizer raised {type(e).__name__}: {e}.")
        for w, g in zip(want, got):
            if w != g:
                diff = [f"{f}: expected {a!r}, got {b!r}" for f, a, b in zip(FIELDS, w[1:], g[1:])
                        if a != b]
                ex.fail(f"{where}; after the tokens up to index {w[0]} "
                        f"({tokenizer.decode(ids[:w[0] + step])!r}): " + "; ".join(diff) + ".")
        if len(want) != len(got):
            ex.fail(f"{where}: the reference gave {len(want)} outputs, yours {len(got)} (the "
                    "request finished at a different step?).")
    _check_in_engine(ex, llm, detokenizer_cls)
    ex.passed(f"{detokenizer_cls.__name__} gave the engine's outputs on {len(cases)} streams "
              f"(characters split across tokens, stop strings spanning tokens, held-back "
              f"text, every output kind), and the engine generating with it returns the "
              f"reference's {len(ENGINE_PROMPTS)} texts.")


def _check_in_engine(ex, llm, detokenizer_cls) -> None:
    processor = llm.llm_engine.output_processor
    params = [SamplingParams(temperature=0, max_tokens=12, **extra) for extra in (
        dict(ignore_eos=True), dict(stop=[" and", "."]),
        dict(stop=["\n"], include_stop_str_in_output=True), dict(stop=["cache"]))]
    runs = []
    for cls in (detok.SlowIncrementalDetokenizer, detokenizer_cls):
        processor.detokenizer_cls = cls
        try:
            llm.llm_engine.reset_prefix_cache()
            outs = llm.generate(ENGINE_PROMPTS, params, use_tqdm=False)
        finally:
            processor.detokenizer_cls = detok.default_detokenizer_cls(processor.tokenizer)
        runs.append([(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                     for o in outs])
    for prompt, want, got in zip(ENGINE_PROMPTS, *runs):
        if want != got:
            ex.fail(f"in the engine, the continuation of {prompt!r}: expected (text, "
                    f"finish_reason, stop_reason) {want!r}, got {got!r}.")
