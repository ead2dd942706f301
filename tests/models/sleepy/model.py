"""Test model that takes one second per batch (for drain-on-SIGTERM tests)."""

import time


class Sleepy:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
    }

    def predict(self, batch):
        if batch["x"].size and batch["x"][0] != 0:  # the warm-up row is 0
            time.sleep(1.0)
        return {"prediction": batch["x"] * 2}
