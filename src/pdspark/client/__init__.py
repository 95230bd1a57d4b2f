"""The pdspark Python SDK: sync and async gRPC clients of the router.

```python
from pdspark.client import Client

with Client("127.0.0.1:50050") as client:
    print(client.generate("def fib(n):", max_tokens=32, temperature=0).text)
    for chunk in client.stream("import os", max_tokens=32):
        print(chunk.text, end="", flush=True)
```
"""

from pdspark.client.async_client import AsyncClient
from pdspark.client.client import Client, ClientError, GenerateResult, StreamChunk, TLSOptions

__all__ = ["AsyncClient", "Client", "ClientError", "GenerateResult", "StreamChunk", "TLSOptions"]
