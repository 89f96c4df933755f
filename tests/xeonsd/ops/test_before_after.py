"""The report opens with the base model's pictures before training against the result's after, at the same seeds,
each row measured against the training images; the run's model card (README.md) shows the same and says how to
load the result in diffusers."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from xeonsd.modelfiles.modelsource import model_fingerprint
from xeonsd.ops import before_after
from xeonsd.ops.model_card import model_card
from xeonsd.ops.report import write_report

YELLOW, GREY = (230, 200, 20), (120, 120, 120)


def _row(folder: Path, colour: tuple[int, int, int], prompt: str, seed: int = 42) -> None:
    folder.mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (16, 16), colour).save(folder / f"image_{i:03d}.png")
    Image.new("RGB", (32, 32)).save(folder / "grid.png")  # the grid is not a picture of the row
    (folder / "timings.json").write_text(json.dumps({"engine": "genai", "seeds": [seed], "prompts": [prompt] * 3}))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A textual inversion run whose before row is grey and whose after row is the training images' yellow."""
    data = tmp_path / "dicoo"
    data.mkdir()
    for i in range(2):
        Image.new("RGB", (64, 64), YELLOW).save(data / f"d{i}.png")
    run = tmp_path / "run"
    _row(run / "images", YELLOW, "a photo of a <dicoo> at the beach")
    _row(run / "images" / "before", GREY, "a photo of a toy at the beach")
    summary = {
        "method": "textual_inversion",
        "placeholder_tokens": ["<dicoo>"],
        "base_model": "/m/demo",
        "family_label": "SD 1.x/2.x",
        "steps": 30,
        "ranks": 16,
        "resolution": 64,
        "result": {"path": "learned_embeds.safetensors", "bytes": 300},
        "data_dir": str(data),
    }
    (run / "train_summary.json").write_text(json.dumps(summary))
    return run


def test_the_report_opens_with_before_and_after_and_their_distances(run: Path) -> None:
    page = write_report(run).read_text()
    pair = before_after.read(run, json.loads((run / "train_summary.json").read_text()))
    assert pair is not None and pair.after.distance == pytest.approx(0, abs=1e-3)
    assert pair.before.distance > 0.3 and pair.ratio < 0.01
    assert [len(pair.before.images), len(pair.after.images)] == [3, 3]  # grid.png left out
    headings = re.findall(r"<h2>([^<]+)</h2>", page)
    assert headings[0] == "Before and after", headings
    assert "Generated images" not in headings  # the after row is those images
    assert re.search(r"before 0\.3\d\d, after 0\.000 \(0\.00×\): the trained model draws closer to the concept", page)
    before, after = (
        page.index("Before: <q>a photo of a toy at the beach"),
        page.index("After: <q>a photo of a &lt;dicoo"),
    )
    assert before < after and 'src="images/before/image_000.png"' in page and 'src="images/image_002.png"' in page
    assert "genai, seed 42" in page


def test_without_the_training_images_the_rows_are_shown_unmeasured(run: Path) -> None:
    summary = json.loads((run / "train_summary.json").read_text())
    for p in Path(summary["data_dir"]).iterdir():
        p.unlink()
    Path(summary["data_dir"]).rmdir()
    page = write_report(run).read_text()
    assert "Before and after" in page and "not measured against them" in page
    assert "distance 0" not in page


def test_a_run_without_a_before_row_shows_its_generated_images(run: Path) -> None:
    for p in (run / "images" / "before").iterdir():
        p.unlink()
    page = write_report(run).read_text()
    assert "Before and after" not in page and "<h2>Generated images</h2>" in page


def test_the_model_card_has_the_hubs_front_matter_the_rows_and_the_loading_code(run: Path) -> None:
    write_report(run)
    card = (run / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "base_model: /m/demo\n" in front and "library_name: diffusers" in front
    assert "- textual-inversion" in front and 'instance_prompt: "<dicoo>"' in front
    for fact in ("- method: textual_inversion", "- steps: 30", "- ranks: 16", "(SD 1.x/2.x)", "- trigger: `<dicoo>`"):
        assert fact in card, fact
    assert "![before, then after](before_after.png)" in card and "bottom row, after: “a photo of a <dicoo>" in card
    picture = Image.open(run / "before_after.png")  # 2 rows of 3 pictures, 16 px scaled to 128, a 4 px gap
    assert picture.size == (3 * 128 + 2 * 4, 2 * 128 + 4)
    assert picture.getpixel((0, 0)) == GREY and picture.getpixel((0, 128 + 4)) == YELLOW
    assert 'pipe.load_textual_inversion(f"{run}/learned_embeds.safetensors", token="<dicoo>")' in card


@pytest.mark.parametrize(
    ("method", "adapter", "loads"),
    [
        ("lora", "lora", "pipe.load_lora_weights(run)"),
        ("lora", "dora", "pipe.load_lora_weights(run)"),
        ("lora", "lokr", "PeftModel.from_pretrained(denoiser, run)"),
        ("full", None, "DiffusionPipeline.from_pretrained(run)"),
    ],
)
def test_each_method_s_card_loads_its_result_its_way(run: Path, method: str, adapter: str | None, loads: str):
    summary = {**json.loads((run / "train_summary.json").read_text()), "method": method}
    del summary["placeholder_tokens"]
    if adapter:
        summary["adapter"] = adapter
    card = model_card(run, summary, before_after.read(run, summary))
    assert loads in card
    assert 'instance_prompt: "a photo of a <dicoo> at the beach"' in card  # the after row's prompt
    compile(card.split("```python\n")[1].split("```")[0], "card", "exec")  # the snippet is Python


def test_a_run_on_the_demo_model_says_so_in_the_report_and_the_card(run: Path) -> None:
    summary = json.loads((run / "train_summary.json").read_text())
    assert not before_after.demo_base(summary)
    assert "demo's pretrained model" not in write_report(run).read_text()
    summary["base_model_fingerprint"] = model_fingerprint(str(before_after.DEMO_MODEL))
    (run / "train_summary.json").write_text(json.dumps(summary))
    assert "the demo's pretrained model (xeonsd/assets/demo_model)" in html.unescape(write_report(run).read_text())
    assert "Its base model is the demo's pretrained model" in (run / "README.md").read_text()


@pytest.mark.parametrize(
    ("before", "after", "says"),
    [
        (0.30, 0.20, "(0.67×): the trained model draws closer to the concept."),
        (
            0.151,
            0.150,
            "(0.99×): the pictures moved less than 5% toward the concept: this run did not learn it visibly",
        ),
        (0.20, 0.25, "(1.25×): the trained model draws farther from the concept than the base model."),
    ],
)
def test_the_verdict_says_whether_the_concept_was_learned(before: float, after: float, says: str) -> None:
    row = before_after.Row("before", ["images/before/a.png"], "p", "genai", [42], before)
    pair = before_after.BeforeAfter(row, before_after.Row("after", ["images/a.png"], "q", "genai", [42], after))
    assert says in before_after.verdict(pair)


def test_a_multi_vector_concept_is_called_by_its_first_token(run: Path) -> None:
    summary = json.loads((run / "train_summary.json").read_text())
    summary["placeholder_tokens"] = ["<dicoo>", "<dicoo>_1", "<dicoo>_2", "<dicoo>_3"]
    card = model_card(run, summary, before_after.read(run, summary))
    assert 'instance_prompt: "<dicoo>"' in card and 'token="<dicoo>")' in card and "<dicoo>_1" not in card


def test_a_prompt_with_quotes_leaves_the_card_s_python_valid(run: Path) -> None:
    summary = {**json.loads((run / "train_summary.json").read_text()), "method": "lora"}
    del summary["placeholder_tokens"]
    (run / "images" / "timings.json").write_text(json.dumps({"prompts": ['a "dicoo" toy\'s hat']}))
    card = model_card(run, summary, before_after.read(run, summary))
    code = card.split("```python\n")[1].split("```")[0]
    compile(code, "card", "exec")
    assert 'pipe("a \\"dicoo\\" toy\'s hat")' in code
