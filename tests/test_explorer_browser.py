"""The explorer page in a real browser: Debian's headless Chromium driven by Playwright.

The page is loaded with every request routed to a recorder that aborts it, on a model of
make-demo's shape (configs/demo.toml, random weights) and a 32-token prompt, on a tiny
llama-style model (RMSNorm, RoPE, grouped-query attention, SwiGLU), and on the real
SmolLM2 GGUF (fixture ``smollm2_gguf``). Set
TINYLM_EXPLORER_MODEL=runs/demo (a trained checkpoint) and TINYLM_EXPLORER_SHOTS=docs to
take the screenshots of docs/explain.md from a real model with the same tests.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import pytest
import torch

from tinylm.core.config import ModelConfig, read_toml
from tinylm.core.model import GPT
from tinylm.data.tokenizers import CharTokenizer
from tinylm.io.checkpoint import load_checkpoint
from tinylm.use.explorer import explorer_data, render_explorer
from tinylm.use.inspection import trace

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
PROMPT = os.environ.get("TINYLM_EXPLORER_PROMPT", "the list is sorted in place, and")
VIEWS = ["steps", "heads", "maps", "lens", "ablation", "lowrank", "next"]


@pytest.fixture(scope="module")
def subject() -> tuple[GPT, object]:
    path = os.environ.get("TINYLM_EXPLORER_MODEL")
    if path:
        return load_checkpoint(path)
    cfg = read_toml(Path(__file__).parents[1] / "configs" / "demo.toml")[0]
    torch.manual_seed(7)
    model = GPT(ModelConfig(vocab_size=1024, **cfg))
    with torch.no_grad():  # weights well above the init so the maps are not uniform
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    return model.eval(), CharTokenizer("abcdefghijklmnopqrstuvwxyz ,.")


@pytest.fixture(scope="module")
def data(subject) -> dict:
    model, tok = subject
    return explorer_data(model, tok, PROMPT, layer=1, head=0)


@pytest.fixture(scope="module")
def traced(subject, data) -> dict:
    return trace(subject[0], data["ids"]).values


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing; run `make browser` (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, data):
    """The static page, loaded with every request recorded and refused."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    requests, errors = [], []
    context.route("**/*", lambda route: (requests.append(route.request.url), route.abort()))
    pg = context.new_page()
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.set_content(render_explorer(data), wait_until="load")
    pg.requests, pg.errors = requests, errors
    yield pg
    context.close()


def _view(page, name: str) -> None:
    page.click(f"#views button[data-view={name}]")
    assert page.locator(f"#view-{name}").is_visible()


def _hover_cell(page, name: str, i: int, j: int) -> tuple[float, float]:
    """Hover cell (i, j) of the heatmap of ``name``; the readout's exact value and the
    value its text shows."""
    canvas = page.locator(f'canvas[data-name="{name}"]').first
    px = float(canvas.get_attribute("data-px"))
    canvas.hover(position={"x": j * px + px / 2, "y": i * px + px / 2})
    readout = page.locator("#readout")
    assert readout.get_attribute("data-name") == name
    assert (readout.get_attribute("data-i"), readout.get_attribute("data-j")) == (str(i), str(j))
    shown = re.search(r"\] = (\S+)", readout.text_content()).group(1)
    shown = shown.replace("\u2212", "-").replace("\u221e", "inf")
    return float(readout.get_attribute("data-value").replace("Infinity", "inf")), float(shown)


def test_loads_offline_and_every_view_renders(page, data) -> None:
    for name in VIEWS:
        _view(page, name)
    assert page.requests == [] and page.errors == []
    C = len(data["ids"])
    assert page.locator("#tokens .tok").count() == C
    assert C == 32 or os.environ.get("TINYLM_EXPLORER_MODEL")
    assert page.locator("#summary").text_content().startswith(f"C = {C} tokens, 4 layers, H = 4")


def test_a_cell_in_the_dom_is_the_librarys_tensor(page, traced, data) -> None:
    _view(page, "steps")
    page.select_option("#layer", "2")
    page.select_option("#head", "3")
    C, D = len(data["ids"]), data["sizes"]["D"]
    for step, name, cells in [
        ("qkv", "layer2.head3.q", [(0, 0), (5, 7), (C - 1, D - 1)]),
        ("qkv", "layer2.head3.v", [(17, 3)]),
        ("scores", "layer2.head3.scores", [(20, 4), (C - 1, C - 1)]),
        ("scaled", "layer2.head3.scaled", [(9, 2)]),
        ("softmax", "layer2.head3.attn", [(12, 3), (C - 1, 0)]),
        ("wo", "layer2.head3.contrib", [(C - 2, 100)]),
        ("x", "layer2.ln1", [(3, 127)]),
    ]:
        page.click(f"#steps button[data-step={step}]")
        for i, j in cells:
            exact, shown = _hover_cell(page, name, i, j)
            expected = float(traced[name][i, j])
            assert abs(exact - expected) <= 1e-5, (name, i, j)
            assert abs(shown - expected) <= 1e-5, (name, i, j)
    page.click("#steps button[data-step=masked]")
    exact, _ = _hover_cell(page, "layer2.head3.masked", 4, 9)
    assert exact == float("-inf")
    assert page.requests == []


def test_switching_layer_head_and_step_updates_the_view(page, traced, data) -> None:
    _view(page, "steps")
    page.select_option("#layer", "0")
    page.select_option("#head", "1")
    page.click("#steps button[data-step=scaled]")
    names = page.locator("#step-maps canvas").evaluate_all("cs => cs.map(c => c.dataset.name)")
    assert names == ["layer0.head1.scaled"]
    assert "layer 0, head 1" in page.locator("#step-title").text_content()
    note = page.locator("#step-note")
    raw = traced["layer0.head1.scores"].double()
    assert float(note.get_attribute("data-var-raw")) == pytest.approx(
        float(raw.var(unbiased=False)), rel=1e-5)
    assert float(note.get_attribute("data-var-scaled")) * data["sizes"]["D"] == pytest.approx(
        float(note.get_attribute("data-var-raw")), rel=1e-9)  # the note's ÷√D claim
    page.select_option("#head", "2")
    page.click("#steps button[data-step=qkv]")
    names = page.locator("#step-maps canvas").evaluate_all("cs => cs.map(c => c.dataset.name)")
    assert names == ["layer0.head2.q", "layer0.head2.k", "layer0.head2.v"]
    page.click("#steps button[data-step=softmax]")
    assert "max |" in note.text_content() and "sum" in note.text_content()

    _view(page, "heads")
    page.select_option("#layer", "3")
    diff = float(page.locator("#heads-diff").get_attribute("data-maxdiff"))
    expected = float((traced["layer3.attn_out"] - traced["layer3.attn_concat"]).abs().max())
    assert diff == pytest.approx(expected, abs=1e-7) and diff < 1e-4
    assert page.locator("#heads-each canvas").count() == 2 * 4

    _view(page, "maps")
    assert page.locator("#maps-grid canvas").count() == 16
    canvas = page.locator('#maps-grid canvas[data-name="layer1.head2.attn"]')
    px = float(canvas.get_attribute("data-px"))
    canvas.click(position={"x": 1, "y": 6 * px + px / 2})  # the row of query 6
    assert page.locator("#maps-row-title").text_content().startswith("row of query 6 ")
    cells = page.locator("#maps-row tr td:nth-child(3)").all_text_contents()
    assert [float(c) for c in cells] == pytest.approx(
        traced["layer1.head2.attn"][6, :7].tolist(), abs=1e-4)
    page.check("input[name=mapmode][value=avg]")
    assert page.locator("#maps-grid canvas").count() == 4
    page.check("input[name=mapmode][value=log]")
    assert page.locator("#maps-grid canvas").count() == 16
    page.check("input[name=mapmode][value=raw]")
    assert page.requests == [] and page.errors == []


def _table(page, box: str) -> list[list[tuple[int, float]]]:
    rows = page.locator(f"{box} tr").evaluate_all(
        "rs => rs.slice(1).map(r => Array.from(r.querySelectorAll('td[data-id]'))"
        ".map(td => [+td.dataset.id, +td.dataset.prob]))")
    return [[(int(i), p) for i, p in row] for row in rows]


def test_ablation_switches_to_the_precomputed_table(page, data) -> None:
    _view(page, "ablation")
    base = _table(page, "#ablation-table")
    assert base == [[(c[0], c[1]) for c in row] for row in data["next"]]
    changed = [a for a in data["ablations"] if a["top"] != data["next"]]
    assert changed, "no ablation changes any table"
    for a in [changed[0], changed[-1]]:
        page.select_option("#ablate", a["key"])
        shown = _table(page, "#ablation-table")
        assert shown == [[(c[0], c[1]) for c in row] for row in a["top"]]
        assert shown != base
        moved = [t for t, row in enumerate(a["top"]) if row[0][0] != data["next"][t][0][0]]
        marked = page.locator("#ablation-table tr").evaluate_all(
            "rs => rs.slice(1).map((r, t) => r.className === 'changed' ? t : -1)"
            ".filter(t => t >= 0)")
        assert marked == moved
    page.select_option("#ablate", "")
    assert _table(page, "#ablation-table") == base


def test_low_rank_lens_and_next_views(page, data) -> None:
    _view(page, "lowrank")
    page.select_option("#layer", "1")
    page.select_option("#head", "3")
    lr = data["lowrank"]["layer1.head3"]
    assert page.locator("#lowrank-bars div").count() == len(lr["singular"]) == 32
    for r in (0, 5, 32):
        page.locator("#rank").fill(str(r))
        out = page.locator("#lowrank-error")
        assert float(out.get_attribute("data-weight-error")) == lr["weight_error"][r]
        assert float(out.get_attribute("data-output-error")) == lr["output_error"][r]
        assert page.locator("#lowrank-bars div.drop").count() == 32 - r
    _view(page, "lens")
    assert page.locator("#lens-table tr").count() == 1 + len(data["ids"])
    last = page.locator("#lens-table tr td:last-child").evaluate_all(
        "ts => ts.map(t => +t.dataset.id)")
    assert last == [row[0][0] for row in data["next"]]  # after the last layer: the output
    _view(page, "next")
    assert _table(page, "#next-table") == [[(c[0], c[1]) for c in row] for row in data["next"]]
    widths = page.locator("#next-table tr:nth-child(2) .bar").evaluate_all(
        "bs => bs.map(b => parseFloat(b.style.width))")
    assert widths == sorted(widths, reverse=True) and widths[0] > 0


def test_screenshots_are_not_blank(page, tmp_path: Path) -> None:
    from PIL import Image

    shots = Path(os.environ.get("TINYLM_EXPLORER_SHOTS") or tmp_path)
    page.select_option("#layer", "1")
    page.select_option("#head", "0")
    plan = [("steps", "softmax"), ("steps", "qkv"), ("heads", None), ("maps", None),
            ("lens", None), ("ablation", None), ("lowrank", None), ("next", None)]
    for view, step in plan:
        _view(page, view)
        if step:
            page.click(f"#steps button[data-step={step}]")
            name = "layer1.head0.attn" if step == "softmax" else "layer1.head0.q"
            _hover_cell(page, name, 9, 8)  # the readout shows one exact value
        if view == "ablation":
            page.select_option("#ablate", "layer1.attn")
        name = f"explorer-{view}{'-' + step if step else ''}.png"
        png = page.screenshot(path=str(shots / name))
        image = Image.open(io.BytesIO(png)).convert("RGB")
        colours = image.getcolors(maxcolors=1 << 20)
        assert colours is not None and len(colours) > 20, name
        background = max(colours)[0]
        assert background < 0.95 * image.width * image.height, name  # not one flat colour
    assert page.requests == [] and page.errors == []


def test_live_mode_posts_the_prompt_and_renders_the_answer(browser) -> None:
    """One page, two modes: with an endpoint the page asks for a prompt and shows what
    the endpoint answers (here Playwright plays the server, returning explorer_data)."""
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz ")
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=32, n_layer=2, n_head=2,
                            n_embd=16)).eval()
    context = browser.new_context()
    posted = []

    def explore(route):
        body = json.loads(route.request.post_data)
        posted.append(body)
        if not body["prompt"]:
            route.fulfill(status=422, content_type="application/json",
                          body=json.dumps({"error": {"message": "the prompt is empty"}}))
            return
        answer = explorer_data(model, tok, body["prompt"], top_k=body["top_k"])
        route.fulfill(status=200, content_type="application/json", body=json.dumps(answer))

    page_html = render_explorer(None, endpoint="/v1/explore")
    context.route("**/*", lambda route: route.abort())  # anything else (a favicon): refused
    context.route("**/v1/explore", explore)
    context.route("**/explorer", lambda r: r.fulfill(content_type="text/html", body=page_html))
    pg = context.new_page()
    pg.goto("http://tinylm.test/explorer")
    assert pg.locator("#live").is_visible() and pg.locator("#tokens .tok").count() == 0
    pg.fill("#prompt-input", "")
    pg.click("#run")
    pg.wait_for_function("document.getElementById('live-status').textContent.includes('empty')")
    pg.fill("#prompt-input", "a list is sorted")
    pg.fill("#topk-input", "3")
    pg.click("#run")
    count = len(tok.encode("a list is sorted"))
    pg.wait_for_function(f"document.querySelectorAll('#tokens .tok').length === {count}")
    assert posted[-1] == {"prompt": "a list is sorted", "top_k": 3}
    _view(pg, "next")
    assert len(_table(pg, "#next-table")[0]) == 3
    context.close()


# --- a llama-style model (RMSNorm, RoPE, GQA, SwiGLU, untied head): every view and step ----


@pytest.fixture(scope="module")
def llama():
    from tinylm.core.config import ARCH_PRESETS

    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz ,.")
    torch.manual_seed(3)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=64, n_layer=3, n_head=4,
                            n_kv_head=2, n_embd=32, **ARCH_PRESETS["llama"]))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(0.3 * torch.randn_like(p))
    return model.eval(), tok


LLAMA_STEPS = ["x", "qkv", "rope", "scores", "scaled", "masked", "softmax", "av", "wo", "ffn"]


def test_llama_page_every_view_and_step_with_the_models_numbers(browser, llama) -> None:
    model, tok = llama
    data = explorer_data(model, tok, PROMPT, layer=1, head=3)
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    requests, errors = [], []
    context.route("**/*", lambda route: (requests.append(route.request.url), route.abort()))
    pg = context.new_page()
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.set_content(render_explorer(data), wait_until="load")
    summary = pg.locator("#summary").text_content()
    assert "RMSNorm" in summary and "RoPE" in summary and "SwiGLU" in summary
    assert "grouped-query attention (4 query, 2 key/value heads)" in summary
    steps = pg.locator("#steps button").evaluate_all("bs => bs.map(b => b.dataset.step)")
    assert steps == LLAMA_STEPS
    for name in VIEWS:
        _view(pg, name)
    _view(pg, "steps")
    # the model's own q and k after the rotation, and its own attention weights
    with torch.no_grad():
        x = trace(model, data["ids"])["layer1.ln1"]
        q, k, _ = model.blocks[1].attn._heads(x[None])  # (1, 4, C, D), (1, 2, C, D)
        _, maps = model.forward_with_attention(torch.tensor([data["ids"]]))
    for step in LLAMA_STEPS:
        pg.click(f"#steps button[data-step={step}]")
        assert pg.locator("#step-maps canvas").count() >= 1, step
        assert pg.locator("#step-maps .legend").count() == pg.locator(
            "#step-maps canvas").count(), step  # every heatmap has its colour scale
        assert pg.locator("#step-note").text_content() or step in ("av", "wo"), step
    pg.click("#steps button[data-step=rope]")
    names = pg.locator("#step-maps canvas").evaluate_all("cs => cs.map(c => c.dataset.name)")
    # head 3 reads key/value head 1, whose tensors go by its first query head, 2
    assert names == ["layer1.head3.q_lin", "layer1.head3.q", "layer1.head2.k_lin",
                     "layer1.head2.k"]
    assert "shared by query heads 2\u20133" in pg.locator("#step-maps").text_content()
    for name, ref, (i, j) in [("layer1.head3.q", q[0, 3], (20, 5)),
                              ("layer1.head2.k", k[0, 1], (31, 7))]:
        exact, shown = _hover_cell(pg, name, i, j)
        assert abs(exact - float(ref[i, j])) <= 1e-5 and abs(shown - float(ref[i, j])) <= 1e-5
    pg.click("#steps button[data-step=softmax]")
    exact, _ = _hover_cell(pg, "layer1.head3.attn", 12, 3)
    assert abs(exact - float(maps[1, 0, 3, 12, 3])) <= 1e-6
    # the axes carry the tokens: rows (queries) and, on a map, columns (keys)
    labels = pg.locator("#step-maps .ylab span").all_text_contents()
    assert labels[:3] == ["t", "h", "e"] and len(labels) == len(data["ids"])
    assert pg.locator("#step-maps .xlab span").count() == len(data["ids"])
    legend = pg.locator("#step-maps .legend")
    assert (legend.get_attribute("data-lo"), legend.get_attribute("data-hi")) == ("0", "1")
    pg.click("#steps button[data-step=scaled]")
    note = pg.locator("#step-note")
    assert "divided by exactly D = 8" in note.text_content() and "E[q\u00b2]" in note.text_content()
    assert float(note.get_attribute("data-qq")) == pytest.approx(
        float(q[0, 3].pow(2).mean()), rel=1e-5)
    pg.click("#steps button[data-step=x]")
    assert "RMS" in pg.locator("#step-note").text_content()
    assert requests == [] and errors == []
    context.close()


def test_llama_page_fetches_a_layer_it_does_not_carry(browser, llama) -> None:
    """A page over its budget carries the opened layer; the static page says how to open
    another, the live one fetches it from /v1/explore (here Playwright plays the server)."""
    from tinylm.use.explorer import explorer_layers

    model, tok = llama
    small = explorer_data(model, tok, PROMPT, layer=1, head=0, max_bytes=1)
    assert small["detail"] == [1]
    context = browser.new_context()
    posted = []

    def explore(route):
        body = json.loads(route.request.post_data)
        posted.append(body)
        if "layers" in body:
            answer = explorer_layers(model, tok, body["prompt"], body["layers"],
                                     top_k=body["top_k"])
        else:
            answer = explorer_data(model, tok, body["prompt"], top_k=body["top_k"], layer=1,
                                   max_bytes=1)
        route.fulfill(status=200, content_type="application/json", body=json.dumps(answer))

    static = context.new_page()
    static.set_content(render_explorer(small), wait_until="load")
    static.select_option("#layer", "2")
    assert "--layer 2" in static.locator("#step-maps .missing").text_content()
    _view(static, "maps")  # every layer's maps are there
    assert static.locator("#maps-grid canvas").count() == 3 * 4
    page_html = render_explorer(None, endpoint="/v1/explore")
    context.route("**/*", lambda route: route.abort())
    context.route("**/v1/explore", explore)
    context.route("**/explorer", lambda r: r.fulfill(content_type="text/html", body=page_html))
    live = context.new_page()
    errors = []
    live.on("pageerror", lambda e: errors.append(str(e)))
    live.goto("http://tinylm.test/explorer")
    live.fill("#prompt-input", PROMPT)
    live.click("#run")
    live.wait_for_function("document.querySelectorAll('#tokens .tok').length > 0")
    live.select_option("#layer", "0")
    live.wait_for_function("document.querySelector('#step-maps canvas') !== null")
    assert posted[-1] == {"prompt": PROMPT, "top_k": 5, "layers": [0]}
    assert live.locator("#step-maps canvas").get_attribute("data-name") == "layer0.ln1"
    _view(live, "ablation")  # layer 0's single heads arrived with its steps
    keys = live.locator("#ablate option").evaluate_all("os => os.map(o => o.value)")
    assert "layer0.head2" in keys and keys.index("layer0.head2") < keys.index("layer0.attn")
    assert errors == []
    context.close()


def test_the_real_smollm2_page(browser, smollm2_gguf, tmp_path_factory, monkeypatch) -> None:
    """`tinylm explain --model SmolLM2.gguf --html` (30 layers × 9 heads, GQA 9/3): the page
    is bounded and loads in Chromium; the layer and head pickers work."""
    from tinylm.cli import main

    monkeypatch.setenv("TINYLM_GGUF_CACHE", str(tmp_path_factory.mktemp("gguf-cache")))
    out = tmp_path_factory.mktemp("smollm2-page") / "out.html"
    assert main(["explain", "--model", str(smollm2_gguf), "--html", str(out), "--prompt",
                 "The capital of France is", "--layer", "12", "--head", "7"]) == 0
    size = out.stat().st_size
    assert size < 12_000_000, size  # bounded: the opened layer's steps and its neighbours'
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    requests, errors = [], []

    def only_the_file(route):
        if route.request.url == out.as_uri():
            route.continue_()
        else:
            requests.append(route.request.url)
            route.abort()

    context.route("**/*", only_the_file)
    pg = context.new_page()
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(out.as_uri())
    summary = pg.locator("#summary").text_content()
    assert "30 layers, H = 9 heads" in summary and "(9 query, 3 key/value heads)" in summary
    assert pg.locator("#layer option").count() == 30 and pg.locator("#head option").count() == 9
    data = pg.evaluate("window.tinylmExplorer.data().detail")
    assert 12 in data and len(data) < 30
    pg.click("#steps button[data-step=rope]")
    assert pg.locator("#step-maps canvas").evaluate_all("cs => cs.map(c => c.dataset.name)") == [
        "layer12.head7.q_lin", "layer12.head7.q", "layer12.head6.k_lin", "layer12.head6.k"]
    pg.select_option("#layer", "29")
    pg.select_option("#head", "8")
    for name in VIEWS:
        _view(pg, name)
    _view(pg, "lowrank")
    assert pg.locator("#lowrank-bars div").count() == 64
    _view(pg, "next")
    top = pg.locator("#next-table tr:last-child td[data-id]").first.text_content()
    assert "Paris" in top  # the real model's next token after "The capital of France is"
    assert requests == [] and errors == []
    context.close()


def test_a_prompt_with_html_in_it_renders_in_the_static_page(browser) -> None:
    """Issue #32: a prompt holding "<!--<script" (or "</script>") blanked the static page;
    its data is now written with <, > and & escaped, and the page renders the prompt."""
    tok = CharTokenizer("<!-script>/&a ")
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=32, n_layer=1,
                            n_head=2, n_embd=8)).eval()
    prompt = "<!--<script a</script>&a"
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    errors: list[str] = []
    context.route("**/*", lambda route: route.abort())
    pg = context.new_page()
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.set_content(render_explorer(explorer_data(model, tok, prompt)), wait_until="load")
    try:
        assert errors == []
        assert pg.locator("#tokens .tok").count() == len(prompt)
        assert pg.locator("#summary").text_content().startswith(f"C = {len(prompt)} tokens")
    finally:
        context.close()
