"""lm-evaluation-harness through ``tinylm serve`` on the real SmolLM2-135M-Instruct: the
harness tokenizes with transformers' AutoTokenizer reading the converted checkpoint's
tokenizer.json (a real byte-level BPE), and its scores equal a reference of the harness's
rules computed from tinylm's model in the test; on 20 easy common-sense items the model
is well above chance (0.25). (Measured once, not a test: transformers' own
``lm_eval --model hf`` on the same weights exported with ``tinylm convert --to-hf`` gives
the same acc, acc_norm and acc_bytes, each log-likelihood within 3e-5.)"""

from __future__ import annotations

import random

from serve_support import one_torch_thread  # noqa: F401  (autouse: one torch thread)
from test_lmeval import _harness_reference, check_against_reference, run_lm_eval, write_task
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.gguf_checkpoint import cached_checkpoint

EASY = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"]),
    ("Water freezes at a temperature of zero degrees", ["Celsius", "hours", "miles",
                                                       "dollars"]),
    ("The opposite of hot is", ["cold", "loud", "green", "tall"]),
    ("A baby cat is called a", ["kitten", "puppy", "calf", "foal"]),
    ("The sun rises in the", ["east", "west", "basement", "ocean"]),
    ("People use an umbrella when it is", ["raining", "sleeping", "eating", "reading"]),
    ("To write on paper you can use a", ["pen", "spoon", "pillow", "shoe"]),
    ("The color of grass is usually", ["green", "purple", "black", "orange"]),
    ("A week has seven", ["days", "months", "years", "minutes"]),
    ("Fish live in", ["water", "trees", "clouds", "deserts"]),
    ("We see with our", ["eyes", "ears", "knees", "elbows"]),
    ("Ice cream tastes", ["sweet", "metallic", "wooden", "loud"]),
    ("The largest ocean on Earth is the", ["Pacific", "Sahara", "Amazon", "Everest"]),
    ("Two plus two equals", ["four", "seven", "ten", "one"]),
    ("Bees make", ["honey", "milk", "bread", "wool"]),
    ("At night the sky is", ["dark", "bright yellow", "made of glass", "square"]),
    ("A doctor works in a", ["hospital", "volcano", "submarine", "cloud"]),
    ("Cows drink", ["water", "gasoline", "ink", "paint"]),
    ("In winter it is often", ["cold", "boiling", "upside down", "invisible"]),
    ("Birds can", ["fly", "read", "drive", "type"]),
]  # the first choice is right; the file shuffles them


def _easy_items() -> list[dict]:
    rng = random.Random(1)
    items = []
    for context, choices in EASY:
        order = list(range(len(choices)))
        rng.shuffle(order)
        items.append({"context": context, "choices": [choices[i] for i in order],
                      "answer": order.index(0)})
    return items


def test_lm_eval_on_smollm2_through_tinylm_serve(smollm2_gguf, tmp_path):
    folder = cached_checkpoint(smollm2_gguf)  # what `tinylm serve --model x.gguf` loads
    items = _easy_items()
    _, tasks = write_task(tmp_path, "easy", items)
    results, samples = run_lm_eval(smollm2_gguf, folder, "easy", tasks, tmp_path / "out",
                                   max_length=2048)
    model, tok = load_checkpoint(folder)
    ref = _harness_reference(model.eval(), tok, items)
    check_against_reference(results, samples, "easy", ref, len(items))
    assert results["results"]["easy"]["acc,none"] >= 0.8  # chance is 0.25
