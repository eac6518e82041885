"""What the notebooks show: the concat-vs-separate comparison (``compare``, ``forwards``), autograd
graphs (``graphs``), BatchNorm statistics (``bn_stats``), memory (``memory``), more than two
inputs (``multisource``), live plots (``live``) and the DDP walkthrough (``ddp_demo``).
"""
