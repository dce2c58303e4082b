"""GET /v1/models, POST /tokenize and POST /detokenize (vLLM's shapes)."""

from __future__ import annotations

from kiln.server.errors import bad_request
from kiln.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from kiln.server.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def models(self) -> ModelList:
        card = ModelCard(
            id=self.model_name,
            root=self.model_name,
            max_model_len=self.max_model_len,
            input_modalities=list(self.engine.input_modalities),
        )
        return ModelList(data=[card])

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("send exactly one of prompt and messages", "prompt")
        if request.messages is not None:
            text, images = self.render_chat(
                request.messages, request.add_generation_prompt, template_kwargs=request.chat_template_kwargs
            )
            token_ids = self.encode(text, "messages", add_special_tokens=bool(request.add_special_tokens))
            if images:  # each image's placeholder stands for its rows' tokens
                vision = self.engine.vision
                assert vision is not None
                token_ids = self.expand_images(token_ids, [vision.placeholder(i) for i in images], "messages")
        else:
            special = True if request.add_special_tokens is None else request.add_special_tokens
            token_ids = self.encode(request.prompt or "", "prompt", add_special_tokens=special)
        token_strs = None
        if request.return_token_strs:
            token_strs = [self.tokenizer.id_to_token(t) or "" for t in token_ids]
        return TokenizeResponse(
            count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids, token_strs=token_strs
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        self.check_token_ids(request.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens, skip_special_tokens=False))
