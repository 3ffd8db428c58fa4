"""Command-line examples: `python -m graphpar.examples.train`, `resnet50_trainer`, `dlrm`."""
