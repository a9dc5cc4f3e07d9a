"""Checker for chapter 07's exercise 7.2: incremental detokenization with stop strings.

The learner's detokenizer runs in the engine's ``OutputProcessor`` beside the engine's classic
one (``SlowIncrementalDetokenizer``), both fed the same random streams of the bundled
tokenizer's tokens (characters spanning tokens, stop strings spanning tokens, every output
kind); every output must be the reference's. Then the real engine generates with it.
"""

from __future__ import annotations

import functools
import random

from minivllm.engine.messages import EngineCoreOutput
from minivllm.course.checks.common import Exercise, check_engine, fail, passed
from minivllm.engine import detokenizer as detok
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


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from minivllm.engine.processor import load_tokenizer
    from minivllm.model_hub import bundled_model_path

    return load_tokenizer(bundled_model_path())


def _cases(tokenizer, seed: int):
    """(name, prompt ids, output ids, params, tokens per step) for the random streams."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    cases = []
    for i in range(48):
        kind = i % 3
        if kind == 0:
            text = rng.choice(TEXTS)
            ids = tokenizer.encode(text)
            start = rng.randrange(0, max(1, len(ids) // 3))
            ids = ids[start:start + rng.randint(8, 40)]
        elif kind == 1:
            ids = [rng.randrange(vocab) for _ in range(rng.randint(8, 30))]
        else:  # text with random ids spliced in
            ids = tokenizer.encode(rng.choice(TEXTS))[: rng.randint(8, 30)]
            for _ in range(3):
                ids.insert(rng.randrange(len(ids)), rng.randrange(vocab))
        decoded = tokenizer.decode(ids)
        stops = []
        if rng.random() < 0.7 and len(decoded) > 6:  # a stop string that occurs (often mid-token)
            a = rng.randrange(len(decoded) // 3, len(decoded) - 2)
            stops.append(decoded[a:a + rng.randint(2, 6)])
        if rng.random() < 0.4:
            stops.append(rng.choice(["\n\n", "END", " the", "🚀", "zzqx"]))
        params = SamplingParams(
            max_tokens=len(ids), stop=stops or None,
            include_stop_str_in_output=rng.random() < 0.3,
            skip_special_tokens=rng.random() < 0.8,
            output_kind=rng.choice(list(RequestOutputKind)),
        )
        prompt = tokenizer.encode(rng.choice(TEXTS))[: rng.randint(1, 12)]
        step = 1 if rng.random() < 0.8 else rng.randint(2, 3)
        cases.append((f"stream {i}", prompt, ids, params, step))
    return cases


def _targeted(tokenizer):
    emoji = tokenizer.encode(" robots 🤖🚀 and 日本語")
    story = tokenizer.encode("Once upon a time there was a STOP sign and then nothing.")
    return [
        ("multi-byte characters split across tokens", [1], emoji,
         SamplingParams(output_kind=RequestOutputKind.DELTA), 1),
        ("a stop string spanning tokens", [1], story,
         SamplingParams(stop=["STOP sign"], output_kind=RequestOutputKind.DELTA), 1),
        ("a stop string kept in the output", [1], story,
         SamplingParams(stop=["STOP sign"], include_stop_str_in_output=True,
                        output_kind=RequestOutputKind.DELTA), 1),
        ("held-back text (a stop string that never completes)", [1], story,
         SamplingParams(stop=["STOP light"], output_kind=RequestOutputKind.CUMULATIVE), 1),
    ]


def _run(tokenizer, detokenizer_cls, case):
    """Feed one stream through an OutputProcessor; the outputs as plain tuples, and aborts."""
    name, prompt, ids, params, step = case
    processor = OutputProcessor(tokenizer, detokenizer_cls)
    processor.add_request("req", None, list(prompt), params, 0.0)
    trace = []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        out = EngineCoreOutput("req", ids[i:i + step], finish_reason="length" if last else None)
        outputs, to_abort = processor.process_outputs([out])
        for o in outputs:
            c = o.outputs[0]
            trace.append((i, c.text, c.finish_reason, c.stop_reason, o.finished, tuple(to_abort)))
        if not outputs and to_abort:
            trace.append((i, None, None, None, None, tuple(to_abort)))
        if not processor.has_unfinished_requests():
            break
    return trace


def _describe(case) -> str:
    name, prompt, ids, params, step = case
    return (f"{name}: {len(ids)} tokens, {step} per step, stop={params.stop!r}, "
            f"include_stop_str_in_output={params.include_stop_str_in_output}, "
            f"skip_special_tokens={params.skip_special_tokens}, "
            f"output_kind={params.output_kind.name}")


def _compare(exercise, tokenizer, case, want, got) -> None:
    for w, g in zip(want, got):
        if w != g:
            i = w[0]
            what = f"after the tokens up to index {i} ({tokenizer.decode(case[2][:i + case[4]])!r})"
            fields = ("text", "finish_reason", "stop_reason", "finished", "requests to abort")
            diff = [f"{f}: expected {a!r}, got {b!r}" for f, a, b in zip(fields, w[1:], g[1:])
                    if a != b]
            fail(exercise, f"{_describe(case)}; {what}: " + "; ".join(diff) + ". " + CONVENTION)
    if len(want) != len(got):
        fail(exercise, f"{_describe(case)}: the reference gave {len(want)} outputs, yours "
                       f"{len(got)} (the request finished at a different step?). " + CONVENTION)


def check_detokenizer(detokenizer_cls, exercise: str = "7.2", seed: int = 0) -> None:
    if not isinstance(detokenizer_cls, type):
        fail(exercise, f"expected a class (detokenizer_cls(tokenizer, prompt_token_ids, params)), "
                       f"got {detokenizer_cls!r}")
    detokenizer_cls = Exercise(exercise, answer=DETOKENIZER_ANSWER,
                               allowed="the tokenizer's decode and convert_ids_to_tokens").take(
        detokenizer_cls, "detokenizer")
    tokenizer = _tokenizer()
    cases = _targeted(tokenizer) + _cases(tokenizer, seed)
    reference = [_run(tokenizer, detok.SlowIncrementalDetokenizer, c) for c in cases]
    for case, want in zip(cases, reference):
        try:
            got = _run(tokenizer, detokenizer_cls, case)
        except NotImplementedError:
            raise
        except AssertionError:
            raise
        except Exception as e:
            fail(exercise, f"{_describe(case)}: your detokenizer raised "
                           f"{type(e).__name__}: {e}. " + CONVENTION)
        _compare(exercise, tokenizer, case, want, got)
    num_texts = _check_in_engine(check_engine(), detokenizer_cls, exercise)
    passed(exercise, f"{detokenizer_cls.__name__} gave the engine's outputs on {len(cases)} streams "
                     f"(characters split across tokens, stop strings spanning tokens, held-back "
                     f"text, every output kind), and the engine generating with it returns the "
                     f"reference's {num_texts} texts.")


def _check_in_engine(llm, detokenizer_cls, exercise: str) -> int:
    from minivllm.course.checks.common import ENGINE_PROMPTS

    processor = llm.llm_engine.output_processor
    runs = []
    for cls in (None, detokenizer_cls):
        processor.detokenizer_cls = cls or detok.SlowIncrementalDetokenizer
        try:
            llm.llm_engine.reset_prefix_cache()
            outs = llm.generate(ENGINE_PROMPTS, [
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=12, stop=[" and", "."]),
                SamplingParams(temperature=0, max_tokens=12, stop=["\n"],
                               include_stop_str_in_output=True),
                SamplingParams(temperature=0, max_tokens=12, stop=["cache"]),
            ], use_tqdm=False)
        finally:
            from minivllm.engine.detokenizer import default_detokenizer_cls

            processor.detokenizer_cls = default_detokenizer_cls(processor.tokenizer)
        runs.append([(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                     for o in outs])
    for prompt, want, got in zip(ENGINE_PROMPTS, *runs):
        if want != got:
            fail(exercise, f"in the engine, the continuation of {prompt!r}: expected (text, "
                           f"finish_reason, stop_reason) {want!r}, got {got!r}. " + CONVENTION)
    return len(ENGINE_PROMPTS)
