"use strict";
// The client's push rate against ioredis's own RPUSH, on a redis-server this script starts (docs/CLIENTS.md
// quotes its output): `node clients/node/bench/push-rate.js [TASKS] [SINGLES]`. Medians of 3 runs each:
//   pushBatch of TASKS small tasks              vs  one ioredis pipeline of TASKS RPUSHes of the same envelopes
//   SINGLES pushes, each awaited before the next  vs  SINGLES RPUSHes, each awaited

const kmq = require("..");
const Redis = require("ioredis");
const { RedisServer } = require("../test/support");

const TASKS = Number(process.argv[2] ?? 100000);
const SINGLES = Number(process.argv[3] ?? 10000);

function median(values) {
  const sorted = values.slice().sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)];
}

async function rate(count, run, reset) {
  const rates = [];
  for (let round = 0; round < 3; round++) {
    await reset();
    const start = process.hrtime.bigint();
    await run();
    const seconds = Number(process.hrtime.bigint() - start) / 1e9;
    rates.push(count / seconds);
  }
  return Math.round(median(rates));
}

async function main() {
  const server = await RedisServer.start();
  const client = new kmq.Client(server.url);
  const plain = new Redis(server.url);
  const reset = () => server.admin.flushall();
  const envelope = (n) => JSON.stringify({ id: `t-${n}`, type: "bench", data: { n } });
  try {
    const tasks = Array.from({ length: TASKS }, (_, n) => ({ type: "bench", data: { n } }));
    const batch = await rate(TASKS, () => client.pushBatch("bench", tasks), reset);
    const texts = Array.from({ length: TASKS }, (_, n) => envelope(n));
    const pipeline = await rate(
      TASKS,
      () => plain.pipeline(texts.map((text) => ["rpush", "kmq:{bench}:ready:normal", text])).exec(),
      reset
    );
    const singles = await rate(
      SINGLES,
      async () => {
        for (let n = 0; n < SINGLES; n++) await client.push("bench", "bench", { n });
      },
      reset
    );
    const plainSingles = await rate(
      SINGLES,
      async () => {
        for (let n = 0; n < SINGLES; n++) await plain.rpush("kmq:{bench}:ready:normal", texts[n]);
      },
      reset
    );
    console.log(`node ${process.version}, ioredis ${require("ioredis/package.json").version}, tasks/s, medians of 3`);
    console.log(`pushBatch of ${TASKS}: ${batch}   ioredis pipeline of ${TASKS} RPUSH: ${pipeline}`);
    console.log(`${SINGLES} single pushes: ${singles}   ${SINGLES} single RPUSH: ${plainSingles}`);
  } finally {
    await client.close();
    plain.disconnect();
    server.stop();
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
