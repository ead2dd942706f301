"""Test model whose load always fails: it never becomes ready."""


class Broken:
    signature = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1]}],
        "outputs": [{"name": "prediction", "datatype": "FP32", "shape": [-1]}],
    }

    def load(self, artifact_dir):
        raise RuntimeError("weights are corrupt")

    def predict(self, batch):
        return batch["x"]
