"""The building blocks families assemble their decoder layers from, one kind per module:
``attention`` (softmax self-attention), ``mlp`` (SwiGLU, GeGLU), ``norm`` (RMSNorm),
``decoder_layer`` (the pre-norm residual layer holding an attention and a feed-forward
block, and its sandwich-norm variant), ``embedding`` (a scaled token embedding) and
``rotary`` (the rotary frequencies, from the config).

Layer blocks take plain sizes and flags, never the config: the family decides what each gets
(a mixture-of-experts block, for one, would build its experts as ``MLP``s of their own
width). New kinds of block (mixture of experts, linear attention) go here as modules of
their own."""
