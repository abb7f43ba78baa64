# Top-level await (IPython runs it) to hide an import from a plain parser.
import asyncio

await asyncio.sleep(0)
from tfedu.softmax import softmax
