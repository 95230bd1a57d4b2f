"""Who may call the router: API keys and their rights, checked on both front ends (HTTP middleware, gRPC
interceptor), and each key's cap on requests in flight."""
