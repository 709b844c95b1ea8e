"""`python -m services.inference.reference`: serve the model at EAGLE3_MODEL_PATH (settings from the environment)."""

import logging

from services.inference.reference.server import serve
from shared.settings import get_settings

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(get_settings())
