"""The HTML report of ``forwardpass explain`` shows speculative decoding's drafts per verifying step: the same
figures as ``--json`` (proposed, accepted, rejected, emitted), read back out of the rendered page."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from forwardpass.config import EngineConfig
from forwardpass.engine.frontend.llm_engine import LLMEngine
from forwardpass.explain.html import render_html
from tests.test_speculative_fast_path import ALWAYS, copy_heavy_prompts


class _Rows(HTMLParser):
    """The cells of the ``drafts`` table's rows, as text, with the token ids of each cell."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[dict]] = []
        self.in_table = False
        self.cell: dict | None = None
        self.in_id = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table" and attrs.get("id") == "drafts":
            self.in_table = True
        elif self.in_table and tag == "tr" and attrs.get("class") == "verify":
            self.rows.append([])
        elif self.in_table and tag == "td" and self.rows:
            self.cell = {"text": "", "ids": [], "classes": []}
            self.rows[-1].append(self.cell)
        elif self.cell is not None and tag == "span":
            self.in_id = attrs.get("class") == "id"
            if "tok" in (attrs.get("class") or ""):
                self.cell["classes"].append(attrs["class"])

    def handle_endtag(self, tag):
        if tag == "table":
            self.in_table = False
        elif tag == "td":
            self.cell = None
        elif tag == "span":
            self.in_id = False

    def handle_data(self, data):
        if self.cell is not None:
            self.cell["text"] += data
            if self.in_id:
                self.cell["ids"].append(int(data))


def test_html_report_shows_the_drafts_of_each_verifying_step(checkpoint_factory):
    from forwardpass.explain import explain

    engine = LLMEngine(checkpoint_factory("qwen3"), EngineConfig(num_kv_blocks=64, speculative_config=ALWAYS))
    ex = explain(copy_heavy_prompts(2)[1], engine=engine, max_tokens=20, temperature=0, ignore_eos=True,
                 hardware=None, overhead=None)
    spec = ex["speculation"]
    assert spec is not None and spec["steps"]
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]  # both colours appear
    page = render_html(ex)
    summary = re.search(r"<p id=speculation>(.*?)</p>", page).group(1)
    assert f"{spec['num_accepted_tokens']} of {spec['num_draft_tokens']} drafts accepted" in summary
    assert f"{spec['mean_acceptance_length']:.2f} tokens per verify step" in summary
    parser = _Rows()
    parser.feed(page)
    assert len(parser.rows) == len(spec["steps"])
    for row, step in zip(parser.rows, spec["steps"]):
        engine_step, bar, proposed, accepted, rejected, emitted = row
        assert int(engine_step["text"]) == step["engine_step"]
        assert proposed["ids"] == [t["id"] for t in step["proposed"]]
        n_ok = step["accepted"]
        assert proposed["classes"] == ["tok acc"] * n_ok + ["tok rej"] * (len(step["proposed"]) - n_ok)
        assert int(accepted["text"]) == n_ok and int(rejected["text"]) == len(step["rejected"])
        assert emitted["ids"] == [t["id"] for t in step["emitted"]]
    # the bars: one green square per accepted draft, one red per rejected, over all steps
    bars = page[page.index("<table id=drafts>"):page.index("</table>", page.index("<table id=drafts>"))]
    assert bars.count('fill="#2e7d32"') == spec["num_accepted_tokens"]
    assert bars.count('fill="#c62828"') == spec["num_draft_tokens"] - spec["num_accepted_tokens"]


def test_html_report_without_speculation_has_no_drafts_section(checkpoint_factory):
    from forwardpass.explain import explain

    engine = LLMEngine(checkpoint_factory("qwen3"), EngineConfig(num_kv_blocks=64))
    ex = explain(copy_heavy_prompts(2)[1], engine=engine, max_tokens=4, temperature=0, ignore_eos=True,
                 hardware=None, overhead=None)
    assert ex["speculation"] is None
    assert "id=drafts" not in render_html(ex)
