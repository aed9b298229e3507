"""The HTTP/JSON API and web console (`http_port`), on the gRPC server's event loop.

One job per module: gateway (the aiohttp server, its routes and checks), calls (an
RPC run through the gRPC server's handlers and interceptors), context (the
servicer context of an HTTP call), routes (the route table and requests built from
HTTP), status (gRPC codes as HTTP statuses), sse (Server-Sent Events), openapi (the
document, from the descriptors), history (the console's charts). The console's
files are in service/console/.
"""
