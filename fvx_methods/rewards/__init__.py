"""Rewards of online RL methods: the protocol and the weighted sum (``reward``), CLIP-based image rewards from local
folders (``clip``: CLIPScore, PickScore) and the toy world's own reward (``world``)."""
