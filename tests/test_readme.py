"""The README's configuration example is a configuration the exporter accepts."""

from __future__ import annotations

import re
from pathlib import Path

from gpubalance.config import load_section
from gpubalance.exporter.config import ExporterConfig

ROOT = Path(__file__).resolve().parents[1]


def test_readme_configuration_example_loads(tmp_path: Path) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    examples = [b for b in blocks if b.startswith("exporter:")]
    assert examples, "the README shows an exporter configuration"
    for text in examples:
        path = tmp_path / "gpubalance.yaml"
        path.write_text(text)
        config = load_section(ExporterConfig, path, "exporter")
        assert config.serving.endpoints[2].gpus == [2, 3]
