from services.producer.app import serve
from shared.settings import get_settings

serve(get_settings())
