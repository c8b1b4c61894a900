"""The OpenAI-compatible API's routes, one `APIRouter` per API family (Anthropic's and
the dashboard's live in their own packages); `api_server.build_app` assembles them.

Each handler reaches the server through the `ServerStateDep` dependency
(server_state.py), and every generation route answers through `generation.generate`,
so that the one path a request takes from body to engine to client is written once.
"""
