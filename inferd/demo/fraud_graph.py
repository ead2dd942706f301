"""The fraud graph example: a cheap model screens every transaction, the XGBoost fraud
model scores only the rows the screen is unsure of.

``python -m inferd.demo.fraud_graph OUT`` builds three folders under ``OUT``:
``fraud`` (the demo's XGBoost model), ``fraud-fast`` (a logistic regression over the
same 30 features, trained on the same data) and ``fraud-graph`` (its ``graph.json``);
push them in that order (see ``docs/guides/graphs.md``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from inferd.demo.build import build_demo_model, fraud_data

UNSURE = (0.1, 0.9)
"""Screen probabilities of fraud between these go to XGBoost. On the demo's test rows
that is 11 % of them, and the graph is right on 97.3 % (the screen alone: 95.3 %,
XGBoost alone: 97.8 %)."""


def graph_spec(unsure: tuple[float, float] = UNSURE) -> dict[str, Any]:
    """The fraud graph: rows whose screen probability of fraud is in ``unsure`` go to
    ``fraud``, the others keep the screen's answer."""
    return {
        "root": "route",
        "nodes": {
            "screen": {"model": "fraud-fast"},
            "score": {"model": "fraud"},
            "route": {
                "switch": [
                    {
                        "when": {"source": "screen.probabilities", "index": 1,
                                 "between": list(unsure)},
                        "then": "score",
                    }
                ],
                "default": "screen",
            },
        },
    }  # fmt: skip


def build_fraud_graph(out_dir: Path) -> dict[str, Path]:
    """The three folders of the example, by model name."""
    import joblib
    from sklearn.linear_model import LogisticRegression

    out_dir = Path(out_dir)
    fraud = build_demo_model("fraud", out_dir).path
    x_train, _, y_train, _ = fraud_data()
    fast = out_dir / "fraud-fast"
    fast.mkdir(parents=True, exist_ok=True)
    screen = LogisticRegression(max_iter=2000).fit(x_train, y_train)
    joblib.dump(screen, fast / "model.joblib")
    graph = out_dir / "fraud-graph"
    graph.mkdir(parents=True, exist_ok=True)
    (graph / "graph.json").write_text(json.dumps(graph_spec(), indent=2))
    return {"fraud": fraud, "fraud-fast": fast, "fraud-graph": graph}


if __name__ == "__main__":
    for name, folder in build_fraud_graph(Path(sys.argv[1])).items():
        print(name, folder)
