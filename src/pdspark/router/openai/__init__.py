"""The router's HTTP API as OpenAI defines it: request models with their bounds, parsing into `SamplingParams`,
response bodies and OpenAI's error object, the chat template, and the OpenAPI document built from the models."""
