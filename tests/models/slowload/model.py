"""Test model whose load takes a minute: longer than a short load timeout.

``INFERD_TEST_LOAD_S`` shortens it where a test only needs the model checked, not served
(``inferd models push`` loads a model to read its signature)."""

import os
import time


class SlowLoad:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
    }

    def load(self, artifact_dir):
        time.sleep(float(os.environ.get("INFERD_TEST_LOAD_S", "60")))

    def predict(self, batch):
        return {"prediction": batch["x"]}
